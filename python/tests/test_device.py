"""The Python package on a device's memory: the tutorial's verbs — generate, score, a LoRA fit with
AdamW, evaluate, saving the adapter, full fine-tuning — with the model on a device against the same
on the host. Here (no GPU) the device is `reference-device`, the reference loops over memory tagged
as a GPU's, and the numbers must equal the host reference's bit for bit: what this checks is that
every operand the package hands the engine reaches the device and comes back. On a machine with a
GPU the same runs compare `cuda` with `cpu` within float32 tolerances (scripts/device-check runs
this file there)."""
import math

import pytest

import meshtune as keras
from conftest import TINY, as_lists
from meshtune._engine import engine

GPUS = engine.gpu_count()
HOST, DEVICE = ("cpu", "cuda") if GPUS else ("reference", "reference-device")
TOLERANCE = 1e-4 if GPUS else 0.0


def close(a, b):
    return math.isclose(a, b, rel_tol=0, abs_tol=TOLERANCE) if TOLERANCE else a == b


def flat(values):
    out = []
    for v in values:
        out.extend(flat(v) if isinstance(v, list) else [v])
    return out


def run(backend, tmp_path, lora=True):
    lm = keras.models.GemmaCausalLM.from_preset(TINY, backend=backend)
    result = {"text": lm.generate("The movie", max_length=12),
              "logits": flat(as_lists(lm.score([[2, 651, 734, 729]])))}
    if lora:
        lm.backbone.enable_lora(rank=4)
    lm.preprocessor.sequence_length = 32
    optimizer = keras.optimizers.AdamW(learning_rate=5e-3, weight_decay=0.01)
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    lm.compile(optimizer=optimizer)
    losses = []
    lm.fit(keras.datasets.load("sample"), batch_size=2, steps_per_epoch=3, verbose=0,
           callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(logs["loss"]))])
    result["losses"] = losses
    result["evaluated"] = lm.evaluate(keras.datasets.load("sample"), batch_size=4, verbose=0, return_dict=True)["loss"]
    result["text_after"] = lm.generate("The movie", max_length=12)
    if lora:
        path = tmp_path / f"{backend}.lora.h5"
        lm.backbone.save_lora_weights(str(path))
        reloaded = keras.models.GemmaCausalLM.from_preset(TINY, backend=HOST)
        reloaded.backbone.enable_lora(rank=4)
        reloaded.backbone.load_lora_weights(str(path))
        reloaded.preprocessor.sequence_length = 32
        reloaded.compile(optimizer=keras.optimizers.AdamW(learning_rate=5e-3))
        result["reloaded"] = reloaded.evaluate(keras.datasets.load("sample"), batch_size=4, verbose=0, return_dict=True)["loss"]
    return result


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_model_on_a_device_computes_as_on_the_host(tmp_path, lora):
    host, device = run(HOST, tmp_path, lora), run(DEVICE, tmp_path, lora)
    assert len(device["losses"]) == 3
    assert all(close(a, b) for a, b in zip(device["losses"], host["losses"])), (device["losses"], host["losses"])
    assert len(device["logits"]) == len(host["logits"]) > 0
    assert all(close(a, b) for a, b in zip(device["logits"], host["logits"]))
    # After fit a device keeps the adapter as low-rank terms, the host merges W + BA: up to rounding.
    assert math.isclose(device["evaluated"], host["evaluated"], abs_tol=1e-5 + TOLERANCE)
    if not GPUS:  # greedy text can flip on a near-tie under GPU rounding
        assert device["text"] == host["text"] and device["text_after"] == host["text_after"]
    if lora:  # the adapter the device trained, saved and loaded on the host, computes what it did
        assert math.isclose(device["reloaded"], device["evaluated"], abs_tol=1e-5 + TOLERANCE)
