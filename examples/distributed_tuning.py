"""The Keras tutorial "Distributed tuning with Gemma" (../shared/seed/), cell by cell, with only the
imports changed — `import meshtune as keras` / `import meshtune as keras_nlp` — and the data read
without TensorFlow. One process:

    python3 examples/distributed_tuning.py PRESET [DATA]

or on a (1, N) mesh of N processes, the weights split as the layout map says:

    mpirun -np 2 python3 examples/distributed_tuning.py PRESET [DATA]

PRESET is a preset name or directory (gemma_7b_en in the tutorial; a tiny one to try it: the test
fixture ../shared/fixtures/keras/preset-gemma2-tiny, or `meshtune init --config tiny-gemma2 DIR`).
DATA is what `meshtune finetune --data` takes (tfds' imdb_reviews TFRecord files, aclImdb, JSONL…);
default: the project's own sample reviews.
"""
import sys

import meshtune as keras
import meshtune as keras_nlp

preset = sys.argv[1] if len(sys.argv) > 1 else "gemma_7b_en"
data = sys.argv[2] if len(sys.argv) > 2 else "sample"
devices = keras.distribution.list_devices()

# Uncomment the line below if you want to enable mixed precision training on GPUs
# keras.mixed_precision.set_global_policy('mixed_bfloat16')

# Create a device mesh with (1, N) shape so that the weights are sharded across all N devices
# (here: the processes of the job).
device_mesh = keras.distribution.DeviceMesh(
    (1, len(devices)),
    ["batch", "model"],
    devices=keras.distribution.list_devices())

model_dim = "model"

layout_map = keras.distribution.LayoutMap(device_mesh)

# Weights that match 'token_embedding/embeddings' will be sharded on the devices
layout_map["token_embedding/embeddings"] = (model_dim, None)
# Regex to match against the query, key and value matrices in the decoder
# attention layers
layout_map["decoder_block.*attention.*(query|key|value).*kernel"] = (
    model_dim, None, None)

layout_map["decoder_block.*attention_output.*kernel"] = (
    model_dim, None, None)
layout_map["decoder_block.*ffw_gating.*kernel"] = (None, model_dim)
layout_map["decoder_block.*ffw_linear.*kernel"] = (model_dim, None)

model_parallel = keras.distribution.ModelParallel(
    device_mesh, layout_map, batch_dim_name="batch")

keras.distribution.set_distribution(model_parallel)
gemma_lm = keras_nlp.models.GemmaCausalLM.from_preset(preset)

decoder_block_1 = gemma_lm.backbone.get_layer('decoder_block_1')
print(type(decoder_block_1))
for variable in decoder_block_1.weights:
  print(f'{variable.path:<58}  {str(variable.shape):<16}  {str(variable.value.sharding.spec)}')

print(gemma_lm.generate("Best comedy movies in the 90s ", max_length=64))

# The tutorial reads IMDB with tensorflow_datasets (batches of 2 reviews, labels dropped) and takes
# 2000 batches; meshtune reads the same files itself.
imdb_train = keras.datasets.load(data)

# Enable LoRA for the model and set the LoRA rank to 4.
gemma_lm.backbone.enable_lora(rank=4)

# Fine-tune on the IMDb movie reviews dataset.

# Limit the input sequence length to 128 to control memory usage.
gemma_lm.preprocessor.sequence_length = 128
# Use AdamW (a common optimizer for transformer models).
optimizer = keras.optimizers.AdamW(
    learning_rate=5e-5,
    weight_decay=0.01,
)
# Exclude layernorm and bias terms from decay.
optimizer.exclude_from_weight_decay(var_names=["bias", "scale"])

gemma_lm.compile(
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    optimizer=optimizer,
    weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
)
gemma_lm.summary()
gemma_lm.fit(imdb_train, epochs=1, batch_size=2)

print(gemma_lm.generate("Best comedy movies in the 90s ", max_length=64))
