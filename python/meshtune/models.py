"""keras_hub.models for meshtune: GemmaCausalLM (and Gemma3CausalLM) with KerasHub's verbs over
the engine's library API (src/api/causal_lm.h) — from_preset under the global distribution and
dtype policy, the backbone's variables with their shardings, enable_lora, generate, compile, fit
(Keras' progress bar and callbacks), evaluate, save_to_preset and the LoRA files."""
import array
import math
import numbers
import sys

from meshtune import _checks, callbacks as callbacks_module, distribution as distribution_module
from meshtune import losses, metrics, mixed_precision, optimizers, samplers, utils
from meshtune._engine import engine


class PartitionSpec(tuple):
    """Prints as JAX prints a sharding's spec: PartitionSpec(None, 'model', None)."""

    def __repr__(self):
        return "PartitionSpec" + tuple.__repr__(self)

    __str__ = __repr__


class _Sharding:
    def __init__(self, spec):
        self.spec = spec


class _Value:
    def __init__(self, variable):
        self._variable = variable
        self.sharding = _Sharding(variable._spec)
        self.shape = variable.shape
        self.dtype = variable.dtype


class Variable:
    """One of backbone.weights: its Keras path, short name, shape, dtype, whether it trains, and
    (value.sharding.spec) how the distribution splits it."""

    def __init__(self, info):
        self.path = info["path"]
        self.name = self.path.rsplit("/", 1)[-1]
        self.shape = tuple(info["shape"])
        self.dtype = info["dtype"]
        self.trainable = info["trainable"]
        sharding = info["sharding"]
        self._spec = PartitionSpec(sharding if sharding else (None,) * len(self.shape))
        self.value = _Value(self)

    def __repr__(self):
        return f"<Variable path={self.path}, shape={self.shape}, dtype={self.dtype}>"


class Layer:
    def __init__(self, name, weights):
        self.name = name
        self.weights = weights

    @property
    def trainable_weights(self):
        return [w for w in self.weights if w.trainable]

    @property
    def non_trainable_weights(self):
        return [w for w in self.weights if not w.trainable]

    def count_params(self):
        return sum(math.prod(w.shape) for w in self.weights)


class GemmaBackbone(Layer):
    def __init__(self, task):
        self._task = task
        self.name = "gemma_backbone"

    @property
    def weights(self):
        return [Variable(v) for v in self._task._lm.variables()]

    def get_layer(self, name=None, index=None):
        if index is not None:
            raise NotImplementedError("get_layer: index= is not implemented by meshtune (give the name)")
        _checks.string("name", name)
        weights = [w for w in self.weights if w.path.startswith(name + "/")]
        if not weights:
            raise ValueError(f"get_layer: no layer {name!r} (e.g. token_embedding, decoder_block_0, final_normalization)")
        return Layer(name, weights)

    def enable_lora(self, rank, target_layer_names=None, target_names=None, alpha=None):
        self._task._enable_lora(rank, target_layer_names or target_names, alpha)

    def save_lora_weights(self, filepath):
        self._task._lm.save_lora_weights(_checks.path("filepath", filepath))

    def load_lora_weights(self, filepath):
        self._task._lm.load_lora_weights(_checks.path("filepath", filepath))

    def __getattr__(self, name):
        config = self._task._lm.config
        if name in config:
            return config[name]
        raise AttributeError(name)


class GemmaCausalLMPreprocessor:
    def __init__(self, task):
        self._task = task

    @property
    def sequence_length(self):
        return self._task._lm.sequence_length

    @sequence_length.setter
    def sequence_length(self, value):
        self._task._lm.sequence_length = _checks.integer("sequence_length", value, 1, 1 << 24)


def _distribution_options():
    d = distribution_module.distribution()
    return d._options() if d is not None else {}


def _examples(data, what):
    """A Python data source as the engine's Dataset, and the batch size it was batched in (or None):
    strings, batches (lists) of strings, {"prompts", "responses"} dicts, {"messages": [...]}
    conversations, or rows of token ids — what a tf.data pipeline hands Keras, without TensorFlow."""
    if isinstance(data, engine.Dataset):
        return data, None
    if isinstance(data, (str, bytes)) or hasattr(data, "__fspath__"):
        spec = data.decode() if isinstance(data, bytes) else str(data.__fspath__() if hasattr(data, "__fspath__") else data)
        return engine.Dataset.load(spec), None
    if isinstance(data, dict):
        data = [data]
    if not hasattr(data, "__iter__"):
        raise TypeError(f"{what}: data must be an iterable of examples or a data file spec, got {type(data).__name__}")
    texts, responses, conversations, rows = [], [], [], []
    batch_size = None

    def text(v):
        if isinstance(v, bytes):
            return v.decode("utf-8", errors="replace")
        if isinstance(v, str):
            return v
        raise TypeError(f"{what}: a text example must be str or bytes, got {type(v).__name__}")

    def add(example):
        if isinstance(example, (str, bytes)):
            texts.append(text(example))
        elif isinstance(example, dict):
            if "messages" in example:
                conversation = []
                for m in example["messages"]:
                    if not isinstance(m, dict) or "role" not in m or "content" not in m:
                        raise TypeError(f"{what}: a message must be a dict with role and content")
                    conversation.append((text(m["role"]), text(m["content"])))
                conversations.append(conversation)
            elif ("prompts" in example or "prompt" in example) and ("responses" in example or "response" in example):
                p = example.get("prompts", example.get("prompt"))
                r = example.get("responses", example.get("response"))
                if isinstance(p, (list, tuple)):
                    if not isinstance(r, (list, tuple)) or len(p) != len(r):
                        raise ValueError(f"{what}: prompts and responses must be lists of the same length")
                    texts.extend(text(x) for x in p)
                    responses.extend(text(x) for x in r)
                else:
                    texts.append(text(p))
                    responses.append(text(r))
            else:
                raise ValueError(f"{what}: a dict example needs 'prompts' and 'responses', or 'messages'; got keys "
                                 f"{sorted(example)[:5]}")
        elif hasattr(example, "__iter__"):
            items = list(example)
            if items and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in items):
                rows.append([_checks.integer("token id", i, 0, 2**31 - 1) for i in items])
            else:
                raise TypeError(f"{what}: an example must be a string, a dict, or a row of token ids")
        else:
            raise TypeError(f"{what}: an example must be a string, a dict, or a row of token ids, got "
                            f"{type(example).__name__}")

    for element in data:
        if isinstance(element, (list, tuple)) and element and all(isinstance(e, (str, bytes, dict)) for e in element):
            batch_size = batch_size or len(element)  # a batch, as tf.data's .batch() yields
            for e in element:
                add(e)
        elif hasattr(element, "numpy"):  # a tf.Tensor of strings (tf.data without .numpy() called)
            value = element.numpy()
            if isinstance(value, bytes):
                add(value)
            else:
                batch_size = batch_size or len(value)
                for e in value:
                    add(e)
        else:
            add(element)
    kinds = sum(1 for k in (texts if not responses else [], responses, conversations, rows) if k)
    if not (texts or conversations or rows):
        raise ValueError(f"{what}: the data yielded no examples")
    if kinds > 1 or (responses and len(responses) != len(texts)):
        raise ValueError(f"{what}: the examples mix kinds (plain texts, prompt/response pairs, conversations, "
                         "token rows): give one kind")
    return engine.Dataset(texts, responses, conversations, rows, "the Python data"), batch_size


def _print_summary(task):
    s = task._lm.summary()

    def size(n):
        for unit in ("B", "KB", "MB", "GB"):
            if n < 1024 or unit == "GB":
                return f"{n:.2f} {unit}"
            n /= 1024

    family = task._lm.config["family"]
    print(f'Model: "{"gemma3" if family == 3 else "gemma"}_causal_lm"')
    print(f" Total params: {s['total']:,} ({size(s['total_bytes'])})")
    print(f" Trainable params: {s['trainable']:,} ({size(s['trainable_bytes'])})")
    print(f" Non-trainable params: {s['non_trainable']:,} ({size(s['non_trainable_bytes'])})")


class GemmaCausalLM:
    """KerasHub's GemmaCausalLM over meshtune's engine."""

    _family = None  # any Gemma; Gemma3CausalLM insists on 3

    def __init__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__}: make one with {type(self).__name__}.from_preset(name or directory)")

    @classmethod
    def from_preset(cls, preset, load_weights=True, dtype=None, models_dir=None, quantize=None, lora=None,
                    backend=None, **kwargs):
        for name in kwargs:
            raise TypeError(f"from_preset: unexpected argument {name}=")
        if not load_weights:
            raise NotImplementedError("from_preset: load_weights=False is not implemented by meshtune "
                                      "(meshtune init writes a randomly initialised preset)")
        policy = mixed_precision.global_policy().name if dtype is None else \
            (dtype.name if isinstance(dtype, mixed_precision.DTypePolicy) else mixed_precision.DTypePolicy(dtype).name)
        options = {"dtype_policy": policy, "distribution": _distribution_options()}
        if models_dir is not None:
            options["models_dir"] = _checks.path("models_dir", models_dir)
        if quantize is not None:
            options["quantize"] = _checks.string("quantize", quantize)
        if lora is not None:
            options["lora"] = _checks.path("lora", lora)
        options["backend"] = distribution_module._backend() if backend is None else _checks.string("backend", backend)
        task = object.__new__(cls)
        task._preset = _checks.path("preset", preset)
        task._options = options
        task._lm = engine.CausalLM.from_preset(task._preset, options)
        if cls._family is not None and task._lm.config["family"] != cls._family:
            raise ValueError(f"{cls.__name__}.from_preset: {preset} is a Gemma {task._lm.config['family']} model "
                             f"(use GemmaCausalLM)")
        task._sampler = samplers.GreedySampler()
        task._compiled = None
        task._lora_seed = None
        task.backbone = GemmaBackbone(task)
        task.preprocessor = GemmaCausalLMPreprocessor(task)
        return task

    # ---- LoRA ----
    def _enable_lora(self, rank, targets, alpha):
        rank = _checks.integer("rank", rank, 1, 1 << 16)
        targets = ["query", "value"] if targets is None else _checks.strings("target_layer_names", targets)
        alpha = 0.0 if alpha is None else _checks.number("alpha", alpha, positive=True)
        seed = utils.random_seed() or 0
        self._lm.enable_lora(rank, targets, alpha, seed)

    # ---- generation ----
    def compile(self, optimizer="auto", loss="auto", weighted_metrics="auto", sampler="greedy", **kwargs):
        for name in kwargs:
            if name in ("metrics", "loss_weights", "run_eagerly", "steps_per_execution", "jit_compile"):
                if name == "jit_compile" or kwargs[name] in (None, False, 1):
                    continue
                raise NotImplementedError(f"compile: {name}= is not implemented by meshtune")
            raise TypeError(f"compile: unexpected argument {name}=")
        if optimizer == "auto":
            optimizer = optimizers.Adam(2e-5)  # KerasHub's default
        if isinstance(optimizer, str):
            if optimizer.lower() in ("adamw", "adam"):
                optimizer = optimizers.AdamW() if optimizer.lower() == "adamw" else optimizers.Adam()
            else:
                raise NotImplementedError(f"compile: optimizer {optimizer!r} is not implemented by meshtune (AdamW, Adam)")
        if not isinstance(optimizer, optimizers.AdamW):
            raise NotImplementedError(f"compile: optimizer {type(optimizer).__name__} is not implemented by meshtune "
                                      "(meshtune.optimizers.AdamW or Adam)")
        if loss not in ("auto", None) and not isinstance(loss, losses.SparseCategoricalCrossentropy):
            if loss != "sparse_categorical_crossentropy":
                raise NotImplementedError(f"compile: loss {loss!r} is not implemented by meshtune "
                                          "(SparseCategoricalCrossentropy(from_logits=True))")
        for m in (weighted_metrics if isinstance(weighted_metrics, (list, tuple)) else []):
            if not isinstance(m, metrics.SparseCategoricalAccuracy) and m != "sparse_categorical_accuracy":
                raise NotImplementedError(f"compile: metric {m!r} is not implemented by meshtune "
                                          "(SparseCategoricalAccuracy)")
        self._sampler = samplers.get(sampler)
        options = optimizer._options()
        self._lm.compile(options)
        self._compiled = optimizer

    def generate(self, inputs, max_length=None, stop_token_ids="auto", strip_prompt=False):
        single = isinstance(inputs, str)
        prompts = [inputs] if single else _checks.strings("inputs", inputs)
        options = dict(self._sampler._options())
        if options.get("seed") is None:
            options["seed"] = utils.random_seed()
        if max_length is not None:
            options["max_length"] = _checks.integer("max_length", max_length, 1, 1 << 24)
        if stop_token_ids is None:
            options["stop_token_ids"] = []
        elif stop_token_ids != "auto":
            options["stop_token_ids"] = [_checks.integer("stop_token_ids", t, 0, 2**31 - 1) for t in stop_token_ids]
        results = self._lm.generate(prompts, options)
        texts = [r["completion"] if strip_prompt else r["text"] for r in results]
        return texts[0] if single else texts

    def score(self, token_ids, padding_mask=None):
        """The logits [batch, length, vocabulary] of whole sequences (a list of rows of token ids;
        padding_mask 1 = token). A numpy array when numpy is installed, else nested lists."""
        rows = [list(r) for r in token_ids]
        if not rows or any(len(r) != len(rows[0]) for r in rows) or not rows[0]:
            raise ValueError("score: token_ids must be a non-empty [batch, length] array")
        B, T = len(rows), len(rows[0])
        ids = [_checks.integer("token id", i, 0, 2**31 - 1) for r in rows for i in r]
        mask = [] if padding_mask is None else [int(bool(m)) for r in padding_mask for m in r]
        raw = array.array("f")
        raw.frombytes(self._lm.logits(ids, mask, B, T))
        V = len(raw) // (B * T)
        try:
            import numpy
            return numpy.frombuffer(raw, dtype=numpy.float32).reshape(B, T, V).copy()
        except ImportError:
            return [[raw[(b * T + t) * V:(b * T + t + 1) * V].tolist() for t in range(T)] for b in range(B)]

    # ---- training ----
    @property
    def stop_training(self):
        return False

    @stop_training.setter
    def stop_training(self, value):
        if value:
            self._lm.stop_training()

    def _run_options(self, batch_size, epochs=1, steps=0, shuffle=True):
        return {"batch_size": batch_size, "epochs": epochs, "steps": steps, "shuffle": bool(shuffle),
                "shuffle_seed": utils.random_seed() or 0}

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_batch_size=None, validation_freq=1):
        if y is not None:
            raise NotImplementedError("fit: y= is not implemented by meshtune (causal LMs learn from x alone)")
        if validation_split:
            raise NotImplementedError("fit: validation_split= is not implemented by meshtune (give validation_data)")
        _checks.not_implemented("fit", class_weight=class_weight, sample_weight=sample_weight,
                                validation_steps=validation_steps, validation_batch_size=validation_batch_size)
        if initial_epoch:
            raise NotImplementedError("fit: initial_epoch= is not implemented by meshtune")
        if self._compiled is None:
            self.compile()
        epochs = _checks.integer("epochs", epochs, 1, 1 << 30)
        data, batched = _examples(x, "fit")
        if batch_size is not None:
            batch_size = _checks.integer("batch_size", batch_size, 1, 1 << 20)
        batch_size = batch_size or batched or 32
        run = self._run_options(batch_size, epochs, 0, shuffle)
        if steps_per_epoch is not None:
            run["steps"] = epochs * _checks.integer("steps_per_epoch", steps_per_epoch, 1, 1 << 40)
            run["epochs"] = 0
        if self._compiled.gradient_accumulation_steps:
            run["grad_accumulation"] = self._compiled.gradient_accumulation_steps
        callbacks = list(callbacks or [])
        for c in callbacks:
            if not isinstance(c, callbacks_module.Callback):
                raise TypeError(f"fit: callbacks must be meshtune.callbacks.Callback objects, got {type(c).__name__}")
        for c in callbacks:
            if isinstance(c, callbacks_module.BackupAndRestore):
                import os
                run["checkpoint_path"] = c.checkpoint_path
                run["checkpoint_every"] = c.save_freq if isinstance(c.save_freq, int) else 0
                run["resume"] = os.path.exists(c.checkpoint_path)
                if self._lm.is_main_process:
                    os.makedirs(c.backup_dir, exist_ok=True)
        history = callbacks_module.History()
        callbacks.append(history)
        for c in callbacks:
            c.set_model(self)
            c.set_params({"epochs": epochs, "verbose": verbose})
        verbose = 1 if verbose == "auto" else _checks.integer("verbose", verbose, 0, 2)
        state = {"epoch": None, "logs": {}}
        main = self._lm.is_main_process

        def close_epoch():
            if state["epoch"] is None:
                return
            logs = dict(state["logs"])
            if verbose == 2 and main:
                print(f"Epoch {state['epoch'] + 1}/{epochs} - " +
                      " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()), file=sys.stderr, flush=True)
            for c in callbacks:
                c.on_epoch_end(state["epoch"], logs)
            state["epoch"] = None

        def handler(event, d):
            if event == "train_begin":
                for c in callbacks:
                    c.on_train_begin({})
            elif event == "epoch_begin":
                close_epoch()
                state["epoch"], state["logs"] = int(d["epoch"]) - 1, {}
                for c in callbacks:
                    c.on_epoch_begin(state["epoch"], {})
            elif event == "step_end":
                state["logs"] = {"loss": d["loss"], "sparse_categorical_accuracy": d["sparse_categorical_accuracy"]}
                for c in callbacks:
                    c.on_train_batch_end(int(d["step_in_epoch"]) - 1, dict(state["logs"]))
            elif event == "train_end":
                close_epoch()

        result = self._lm.fit(data, run, handler, verbose == 1)
        if validation_data is not None:
            val_loss, val_accuracy = self.evaluate(validation_data, batch_size=batch_size, verbose=0)
            for key, value in (("val_loss", val_loss), ("val_sparse_categorical_accuracy", val_accuracy)):
                history.history.setdefault(key, []).append(value)
        logs = {k: v[-1] for k, v in history.history.items()}
        for c in callbacks:
            c.on_train_end(logs)
        history.interrupted = result["interrupted"]
        history.steps = result["steps"]
        history.train_seconds = result["train_seconds"]
        return history

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", steps=None, return_dict=False, **kwargs):
        if y is not None:
            raise NotImplementedError("evaluate: y= is not implemented by meshtune")
        _checks.not_implemented("evaluate", steps=steps, **kwargs)
        data, batched = _examples(x, "evaluate")
        batch_size = (None if batch_size is None else _checks.integer("batch_size", batch_size, 1, 1 << 20)) \
            or batched or 32
        loss, accuracy = self._lm.evaluate(data, self._run_options(batch_size, 1, 0, False))
        if return_dict:
            return {"loss": loss, "sparse_categorical_accuracy": accuracy}
        return [loss, accuracy]

    # ---- inspection and files ----
    def summary(self, **kwargs):
        _print_summary(self)

    def count_params(self):
        return self.backbone.count_params()

    def save_to_preset(self, preset_dir):
        self._lm.save_to_preset(_checks.path("preset_dir", preset_dir))

    def export(self, directory, format="hf"):
        self._lm.export(_checks.string("format", format), _checks.path("directory", directory))

    def quantize(self, mode, **kwargs):
        _checks.string("mode", mode)
        if mode != "int8":
            raise NotImplementedError(f"quantize: mode {mode!r} is not implemented by meshtune (int8)")
        if kwargs:
            raise NotImplementedError(f"quantize: {sorted(kwargs)[0]}= is not implemented by meshtune")
        if self._compiled is not None or self._lm.lora_rank:
            raise ValueError("quantize: quantize right after from_preset, before enable_lora, compile and fit")
        options = dict(self._options, quantize="int8")
        self._lm = engine.CausalLM.from_preset(self._preset, options)  # Keras' arithmetic, applied as it loads
        self._options = options


class Gemma3CausalLM(GemmaCausalLM):
    _family = 3


Backbone = GemmaBackbone
