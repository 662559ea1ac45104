"""A 5-step LoRA run with the tutorial's layout map, as a script for mpirun (each rank writes its
result to OUT_DIR/rank<r>.json: mpirun interleaves the ranks' stdout) and as a function for the
one-process reference (test_mesh.py)."""
import os
import json
import sys

import meshtune as keras


def run(preset, mesh=True):
    keras.distribution.set_distribution(None)
    if mesh:
        device_mesh = keras.distribution.DeviceMesh((1, len(keras.distribution.list_devices())), ["batch", "model"])
        layout_map = keras.distribution.LayoutMap(device_mesh)
        layout_map["token_embedding/embeddings"] = ("model", None)
        layout_map["decoder_block.*attention.*(query|key|value).*kernel"] = ("model", None, None)
        layout_map["decoder_block.*attention_output.*kernel"] = ("model", None, None)
        layout_map["decoder_block.*ffw_gating.*kernel"] = (None, "model")
        layout_map["decoder_block.*ffw_linear.*kernel"] = ("model", None)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(device_mesh, layout_map,
                                                                             batch_dim_name="batch"))
    lm = keras.models.GemmaCausalLM.from_preset(preset)
    specs = {w.path: str(w.value.sharding.spec) for w in lm.backbone.weights}
    lm.backbone.enable_lora(rank=4)
    lm.preprocessor.sequence_length = 32
    lm.compile(optimizer=keras.optimizers.AdamW(learning_rate=5e-3, weight_decay=0.01))
    losses = []
    lm.fit(keras.datasets.load("sample"), batch_size=2, steps_per_epoch=5, verbose=0,
           callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(logs["loss"]))])
    text = lm.generate("I loved", max_length=12)
    keras.distribution.set_distribution(None)
    return {"specs": specs, "losses": losses, "text": text}


if __name__ == "__main__":
    result = run(sys.argv[1])
    with open(os.path.join(sys.argv[2], f"rank{keras._engine.world_rank()}.json"), "w") as out:
        json.dump(result, out)
