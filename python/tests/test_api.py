"""The Python package against the command line: the same numbers bit for bit, Keras' names and
call shapes, and errors as Python exceptions with the engine's one-line messages."""
import json
import os

import pytest

import meshtune
import meshtune as keras
import meshtune as keras_nlp
from conftest import TINY, TINY2, as_lists, read_npy_f32, run_cli, write_npy_i32


def test_greedy_generate_equals_the_command_line():
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    prompts = ["The licenses", "Copyright"]
    got = lm.generate(prompts, max_length=10)
    assert got == ["The licensesssssss", "Copyright" * 9]  # spec §6, verified against real Keras
    cli = run_cli("generate", TINY, "--prompt", prompts[0], "--prompt", prompts[1], "--max-length", "10")
    for text in got:
        assert text in cli
    assert lm.generate("The licenses", max_length=10, strip_prompt=True) == "ssssss"
    assert isinstance(lm.generate("The licenses", max_length=4), str)


def test_logits_equal_the_command_line_bit_for_bit(tmp_path):
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    rows = [[2, 549, 323, 268, 0, 0], [2, 474, 309, 265, 286, 352]]
    write_npy_i32(tmp_path / "ids.npy", rows)
    run_cli("logits", TINY, "--token-ids", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "logits.npy"))
    shape, want = read_npy_f32(tmp_path / "logits.npy")
    got = as_lists(lm.score(rows))
    flat = [v for b in got for t in b for v in t]
    assert shape == (2, 6, 1000)
    assert flat == list(want)


def run_python_lora(steps, out):
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    lm.backbone.enable_lora(rank=4)
    lm.preprocessor.sequence_length = 32
    optimizer = keras.optimizers.AdamW(learning_rate=5e-3, weight_decay=0.01)
    optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])
    lm.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=optimizer,
               weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
    losses = []
    history = lm.fit(meshtune.datasets.load("sample"), batch_size=2, steps_per_epoch=steps, verbose=0,
                     callbacks=[keras.callbacks.LambdaCallback(
                         on_train_batch_end=lambda batch, logs: losses.append(logs["loss"]))])
    lm.backbone.save_lora_weights(str(out / "python.lora.h5"))
    return lm, losses, history


def test_a_lora_run_equals_finetune_bit_for_bit(tmp_path):
    lm, losses, history = run_python_lora(5, tmp_path)
    run_cli("finetune", TINY, "--data", "sample", "--seq-len", "32", "--batch-size", "2", "--steps", "5",
            "--lr", "5e-3", "--weight-decay", "0.01", "--no-decay", "bias,scale", "--no-progress",
            "--log-jsonl", str(tmp_path / "log.jsonl"), "--out", str(tmp_path / "run"))
    cli = [json.loads(line)["epoch_loss"] for line in open(tmp_path / "log.jsonl")]
    assert len(losses) == 5
    assert losses == cli
    assert history.history["loss"][-1] == cli[-1]
    # The adapter: same values as the command line's (both written by the engine; compare the tensors).
    a = meshtune.models.GemmaCausalLM.from_preset(TINY, lora=str(tmp_path / "python.lora.h5"))
    b = meshtune.models.GemmaCausalLM.from_preset(TINY, lora=str(tmp_path / "run/adapter.lora.h5"))
    assert as_lists(a.score([[2, 549, 323, 268]])) == as_lists(b.score([[2, 549, 323, 268]]))
    assert as_lists(a.score([[2, 549, 323, 268]])) != \
        as_lists(meshtune.models.GemmaCausalLM.from_preset(TINY).score([[2, 549, 323, 268]]))


def test_keras_names_and_shapes():
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    block = lm.backbone.get_layer("decoder_block_1")
    paths = [w.path for w in block.weights]
    assert paths[0] == "decoder_block_1/pre_attention_norm/scale"
    query = [w for w in block.weights if w.name == "kernel" and "query" in w.path][0]
    assert query.shape == (4, 64, 16)
    assert str(query.value.sharding.spec) == "PartitionSpec(None, None, None)"
    assert str(block.weights[0].value.sharding.spec) == "PartitionSpec(None,)"
    assert lm.preprocessor.sequence_length > 0
    lm.backbone.enable_lora(rank=2)
    trainable = lm.backbone.trainable_weights
    assert {w.name for w in trainable} == {"lora_kernel_a", "lora_kernel_b"}
    assert sum(1 for w in trainable) == 2 * 2 * 2  # 2 layers × query/value × A/B


def test_mixed_bfloat16_changes_the_numbers_and_float32_does_not():
    rows = [[2, 549, 323, 268]]
    f32 = as_lists(keras_nlp.models.GemmaCausalLM.from_preset(TINY).score(rows))
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    bf16 = as_lists(keras_nlp.models.GemmaCausalLM.from_preset(TINY).score(rows))
    assert f32 != bf16
    diff = max(abs(a - b) for x, y in zip(f32[0], bf16[0]) for a, b in zip(x, y))
    assert diff < 0.5


def test_errors_are_python_exceptions_with_the_engine_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        keras_nlp.models.GemmaCausalLM.from_preset(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="preset must be a string"):
        keras_nlp.models.GemmaCausalLM.from_preset(None)
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    with pytest.raises(TypeError, match="max_length must be an integer"):
        lm.generate("x", max_length="10")
    with pytest.raises(ValueError, match="max_length must be at most"):
        lm.generate("x", max_length=2**80)
    with pytest.raises(ValueError, match="max_length must be at least 1"):
        lm.generate("x", max_length=0)
    with pytest.raises(TypeError, match="inputs must hold strings"):
        lm.generate(["x", 3])
    with pytest.raises(TypeError, match="rank must be an integer"):
        lm.backbone.enable_lora(rank=None)
    with pytest.raises(ValueError, match="the data yielded no examples"):
        lm.fit([], epochs=1, verbose=0)
    with pytest.raises(NotImplementedError, match="validation_split"):
        lm.fit(["a b c"], validation_split=0.1)
    with pytest.raises(NotImplementedError, match="sampler 'beam'"):
        lm.compile(sampler="beam")
    with pytest.raises(ValueError, match="unknown sampler"):
        lm.compile(sampler="nope")
    with pytest.raises(ValueError, match="beta_1 and beta_2 must be in"):
        keras.optimizers.AdamW(beta_1=1.0)
    with pytest.raises(ValueError, match="learning_rate must be finite"):
        keras.optimizers.AdamW(learning_rate=float("nan"))
    with pytest.raises(ValueError, match="needs 8 devices"):
        keras.distribution.DeviceMesh((1, 8), ["batch", "model"])
    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"])
    layout = keras.distribution.LayoutMap(mesh)
    layout["token_embedding/embeddings"] = ("nope", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(mesh, layout, batch_dim_name="batch"))
    with pytest.raises(ValueError, match="nope"):
        keras_nlp.models.GemmaCausalLM.from_preset(TINY)


def test_a_raising_generator_and_a_raising_callback_propagate_and_leave_the_model_usable():
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    lm.backbone.enable_lora(rank=2)
    lm.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3))

    def broken():
        yield "one review"
        raise OSError("the disk went away")

    with pytest.raises(OSError, match="the disk went away"):
        lm.fit(broken(), batch_size=1, verbose=0)

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("callback failed at batch 1")

    data = ["a good film", "a bad film", "an odd film", "a long film"]
    with pytest.raises(RuntimeError, match="callback failed at batch 1"):
        lm.fit(data, batch_size=1, epochs=1, verbose=0, callbacks=[Boom()])
    # Still usable: a later fit trains one epoch's steps more (continuing the interrupted pass).
    history = lm.fit(data, batch_size=1, epochs=1, verbose=0)
    assert history.steps == 2 + 4 and not history.interrupted
    assert isinstance(lm.generate("a", max_length=6), str)


def test_a_callback_stops_training_between_steps():
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    lm.backbone.enable_lora(rank=2)
    lm.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3))
    seen = []

    class StopAfterTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)
            if batch == 1:
                self.model.stop_training = True

    history = lm.fit(["a b", "c d", "e f", "g h", "i j"], batch_size=1, verbose=0, callbacks=[StopAfterTwo()])
    assert seen == [0, 1]
    assert history.interrupted


def test_chat_and_prompt_response_data():
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    lm.backbone.enable_lora(rank=2)
    lm.preprocessor.sequence_length = 32
    lm.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3))
    pairs = {"prompts": ["Is it good?", "Is it long?"], "responses": ["Yes.", "No."]}
    assert len(lm.fit([pairs], verbose=0).history["loss"]) == 1
    chats = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "model", "content": "Hello!"}]}] * 2
    assert len(lm.fit(chats, batch_size=2, verbose=0).history["loss"]) == 1
    with pytest.raises(ValueError, match="mix kinds"):
        lm.fit(["plain", {"prompts": "p", "responses": "r"}], verbose=0)


def test_import_is_fast_and_works_from_any_directory(tmp_path):
    import subprocess
    import sys
    import time
    env = dict(os.environ)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import meshtune"], check=True, cwd=tmp_path, env=env)
    assert time.perf_counter() - start < 2.0  # a whole interpreter start included


def test_python_runs_the_blas_kernels_the_command_line_chose(tmp_path):
    """OpenBLAS' kernel family is chosen before the engine loads (meshtune/_engine.py) from the cache
    the command line measures into, so both run the same kernels; an edited cache is obeyed."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "MESHTUNE_BLAS_NOTE")}
    env["MESHTUNE_CACHE_DIR"] = str(tmp_path)
    family = run_cli("info", "--system", env=env).split("OpenBLAS kernels: ")[1].split(" ")[0]
    code = "from meshtune._engine import engine; print(engine._blas_kernel_choice())"

    def python_choice():
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout

    assert python_choice().startswith(f"OpenBLAS kernels: {family} (")
    [cache_file] = tmp_path.glob("blas-kernels-*.json")
    cache = json.loads(cache_file.read_text())
    for other in cache["rates"]:
        cache["core"] = other
        cache_file.write_text(json.dumps(cache))
        got = python_choice()  # names `other` only when OpenBLAS loaded that family
        assert got.startswith(f"OpenBLAS kernels: {other} (") and "cached in" in got, got


def test_ctrl_c_stops_fit_between_steps_and_leaves_the_model_usable():
    import signal
    import subprocess
    import sys
    script = f"""
import sys, meshtune as keras
lm = keras.models.GemmaCausalLM.from_preset({TINY!r})
lm.backbone.enable_lora(rank=2)
lm.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3))
class Tell(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print("step", batch, flush=True)
try:
    lm.fit(keras.datasets.load("sample"), batch_size=1, steps_per_epoch=100000, verbose=0, callbacks=[Tell()])
except KeyboardInterrupt:
    print("interrupted; generate:", lm.generate("I loved", max_length=8), flush=True)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith("step 0")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "interrupted; generate: I loved" in out


def test_a_huge_prompt_is_cut_before_tokenizing():
    import resource
    import time
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    start = time.perf_counter()
    text = lm.generate("x" * (50 << 20), max_length=8)  # 50 MB without a space
    assert time.perf_counter() - start < 10
    assert text.startswith("xxx")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 2 << 20  # KiB: well under 2 GiB


def test_a_generation_too_big_for_the_machine_is_refused_at_once():
    import time
    lm = keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"generate: 100000 prompts × max_length 8192 \(--max-length\) need about"):
        lm.generate(["a"] * 100000, max_length=8192)
    assert time.perf_counter() - start < 10


def test_devices_are_gpus_where_there_are_and_a_gpu_mesh_computes_on_them():
    from meshtune._engine import engine
    gpus = engine.gpu_count()
    assert keras.distribution.list_devices("cpu") == ["cpu:0"]
    assert keras.distribution.list_devices("gpu") == (["gpu:0"] if gpus else [])
    assert keras.distribution.list_devices() == (["gpu:0"] if gpus else ["cpu:0"])
    if gpus:
        return
    # A mesh of GPU devices asks for the CUDA backend: here there is none to compute on.
    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices=["gpu:0"])
    keras.distribution.set_distribution(keras.distribution.DataParallel(device_mesh=mesh))
    try:
        with pytest.raises(ValueError, match="--device cuda: no usable NVIDIA GPU"):
            keras_nlp.models.GemmaCausalLM.from_preset(TINY)
    finally:
        keras.distribution.set_distribution(None)
    assert keras_nlp.models.GemmaCausalLM.from_preset(TINY).generate("The", max_length=4)
