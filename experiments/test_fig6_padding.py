"""The padding study's diagnostic model and its report table, on small shapes (no data needed)."""

import json

import numpy as np

from fedlayer.models import build_model
from fig6_padding import pool_before_classifier, table


class _Config:
    model, width, dtype, padding = "dcnn", 1 / 64, "float32", "same"


class _Dataset:
    feature_shape, n_classes = (32, 32, 3), 10


def _build(config, dataset):
    return build_model(config.model, dataset.feature_shape, dataset.n_classes, width=config.width,
                       dtype=np.dtype(config.dtype), padding=config.padding)


def test_the_pool_goes_right_before_the_classifier():
    unpooled = _build(_Config, _Dataset)
    pooled = pool_before_classifier(_build, 4)(_Config, _Dataset)
    last = pooled.trainable[-1]
    # 'same' keeps 8 x 8 maps; pooled by 4 the classifier sees the 2 x 2 positions of 'valid'
    assert unpooled.input_shape_of(len(unpooled.layers) - 2) == (8, 8, 32)
    assert pooled.input_shape_of(len(pooled.layers) - 2) == (2, 2, 32)
    assert pooled.layers[last].ls_shape(pooled.input_shape_of(last)) == (2 * 2 * 32 + 1, 10)
    assert [type(layer).__name__ for layer in pooled.layers[:-3]] == [
        type(layer).__name__ for layer in unpooled.layers[:-2]]


def test_rows_sort_by_padding_then_by_the_classifiers_width():
    def row(width, padding, pool, accuracy):
        return {"width": width, "padding": padding, "classifier_pool": pool, "test_accuracy": accuracy,
                "train_accuracy": accuracy, "classifier_d": 10, "wall_s": 1.0, "peak_rss_bytes": 2**30}

    lines = table([row(0.25, "same", 1, 0.6527), row(0.25, "valid", 1, 0.5554), row(0.25, "same", 2, 0.6516)])
    assert [line.split(" | ")[1:3] for line in lines[2:]] == [["valid", "-"], ["same", "2x2"], ["same", "-"]]
    assert "65.27" in lines[-1] and "55.54" in lines[2]
    assert [line.split(" | ")[0] for line in table([row(1.0, "same", 2, 0.7), row(0.5, "same", 2, 0.68)])[2:]] == [
        "| 1/2", "| 1"]


def test_fig6_report_states_the_full_width_padding_row_when_there_is_one(tmp_path):
    from fig6_cifar import padding_sentence

    rows = tmp_path / "fig6_padding.json"
    assert "most likely" in padding_sentence(rows)
    rows.write_text(json.dumps([{"width": 0.25, "padding": "same", "classifier_pool": 2, "test_accuracy": 0.6516,
                                 "classifier_d": 8193},
                                {"width": 1.0, "padding": "same", "classifier_pool": 2, "test_accuracy": 0.7021,
                                 "classifier_d": 32769}]))
    sentence = padding_sentence(rows)
    assert "**70.21 %** at full width" in sentence and "32,769^2 Gram" in sentence and "65.16" not in sentence
    dual = tmp_path / "fig6_dual_classifier.json"
    assert padding_sentence(rows, dual) == sentence
    dual.write_text(json.dumps([{"width": 0.0625, "classifier_inputs": 8193, "train_rows": 44963,
                                 "test_accuracy": 0.5995},
                                {"width": 1.0, "classifier_inputs": 131073, "train_rows": 44963,
                                 "test_accuracy": 0.675, "train_accuracy": 1.0}]))
    with_dual = padding_sentence(rows, dual)
    assert with_dual.startswith(sentence) and "131,073-input classifier" in with_dual
    assert "**67.50 %**, 2.56 points below" in with_dual and "fits 100.00 %" in with_dual
    assert "59.95" not in with_dual
