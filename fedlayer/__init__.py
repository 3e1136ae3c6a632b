"""Analytic federated learning (FedACnnL, pFedACnnL) composed from fastls kernels."""

__version__ = "0.1.0"
