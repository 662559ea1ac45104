// Which tensors a Trainer trains and where they live: the working copies forward/backward use,
// the blocks the optimizer updates under a mesh, and the collectives that turn this process'
// gradients into its blocks' gradients (sums over the batch axis and the tensor-parallel axis).
#include <algorithm>

#include "core/error.h"
#include "distribution/collectives.h"
#include "model/variables.h"
#include "train/host_staging.h"
#include "train/trainer.h"

namespace meshtune {

// A variable's value storage (fp32 and writable for trainable variables: the model's weights, in
// host memory) and the gradient pointer that backward fills for it.
struct SlotRef {
  Floats value;
  size_t size = 0;
  float** grad = nullptr;
};

static SlotRef slot_ref(GemmaModel& m, ModelGradients& g, const VariableSpec& spec) {
  float*& grad = g.of(spec.slot, spec.layer);
  if (WeightMatrix* w = m.matrix(spec.slot, spec.layer)) {
    const size_t n = size_t(w->rows * w->cols);
    return {Floats(const_cast<float*>(w->f32()), n, w->device), n, &grad};
  }
  const WeightVector* v = m.vector(spec.slot, spec.layer);
  return {v->values(), v->size(), &grad};
}

// Full fine-tuning's working copy of variable `spec`: writable fp32 values of its own in the
// backend's memory (host weights are converted and uploaded; weights already there are copied, or
// widened from bf16, by the backend), so training never writes into the weights it was given.
static void make_trainable_copy(Backend& b, GemmaModel& m, const VariableSpec& spec) {
  auto values = std::make_shared<FloatBuffer>();
  WeightMatrix* w = m.matrix(spec.slot, spec.layer);
  WeightVector* v = m.vector(spec.slot, spec.layer);
  const size_t n = w ? size_t(w->rows * w->cols) : v->size();
  b.resize(*values, n);
  if ((w ? w->device : v->device()) != b.device()) {
    b.upload(variable_values(m, spec), *values);
  } else if (v) {
    b.copy(*v, int64_t(n), *values);
  } else if (w->dtype == DType::F32) {
    b.copy(ConstFloats(w->f32(), n, w->device), int64_t(n), *values);
  } else {
    check(w->dtype == DType::BF16, spec.keras_path, ": int8 weights are frozen: train them with LoRA");
    b.widen_bf16(Span<const uint16_t>(w->bf16(), n, w->device), int64_t(n), *values);
  }
  if (v) {
    *v = WeightVector(std::move(values));
    return;
  }
  WeightMatrix trainable = *w;
  trainable.dtype = DType::F32;
  trainable.data = values->data();
  trainable.owner = values;
  trainable.mapped = false;
  trainable.scales = nullptr;
  trainable.device = b.device();
  *w = trainable;
}

Floats Trainer::gradient_storage(size_t i, size_t size, float** backward_hook) {
  FloatBuffer& grad = grad_storage_[i];
  backend_->resize_zeroed(grad, size);
  *backward_hook = grad.data();
  return grad;
}

static std::string short_name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

Trainer::Trainer(Backend& backend, MatmulPrecision precision, GemmaModel base, std::optional<LoraWeights> lora,
                 const FitOptions& options, const Distribution& distribution)
    : backend_(&backend), precision_(precision), dist_(distribution), model_(std::move(base)), lora_(std::move(lora)),
      options_(options) {
  config_ = model_.config;
  int8_base_ = model_.has_int8();
  const GemmaConfig& c = config_;
  grads_.layers.assign(size_t(c.num_layers), LayerGradients{});
  if (lora_ && lora_->adapters.empty()) lora_.reset();
  if (lora_) {
    validate_lora(c, *lora_, "LoRA adapter");
    lora_tensors_ = LoraTensors(backend, *lora_);
    for (size_t i = 0; i < lora_->adapters.size(); ++i) {
      const LoraAdapter& ad = lora_->adapters[i];
      const std::string path = ad.keras_path(c);
      params_.push_back({path + "/lora_kernel_a", "lora_kernel_a", ad.a_shape, lora_tensors_.a[i],
                         lora_tensors_.grad_a[i], ad.a.size()});
      params_.push_back({path + "/lora_kernel_b", "lora_kernel_b", ad.b_shape, lora_tensors_.b[i],
                         lora_tensors_.grad_b[i], ad.b.size()});
    }
  } else {
    // Writable fp32 working copies (full fine-tuning updates in place). Under a mesh
    // place_variables() makes them: only this process' part, read from the stored weights.
    const auto specs = gemma_variables(c);
    grad_storage_.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!dist_.mesh) make_trainable_copy(backend, model_, specs[i]);
      params_.push_back({specs[i].keras_path, short_name(specs[i].keras_path), specs[i].hf_shape, {}, {},
                         size_t(num_elements(specs[i].hf_shape))});
      if (dist_.mesh) continue;
      SlotRef ref = slot_ref(model_, grads_, specs[i]);
      params_.back().value = ref.value;
      params_.back().grad = gradient_storage(i, ref.size, ref.grad);
    }
  }
  place_variables();
  optimizer_ = std::make_unique<AdamW>(backend, options_.adamw, params_);
  if (dist_.mesh && dist_.mesh->size() > 1)
    optimizer_->sum_squared_norms = [this](std::vector<double>& squared_norms) {
      // Every process holds a block of each variable, and each block is held by mesh size ÷
      // (number of blocks) processes: sum the blocks' squares over all, counting each block once.
      DeviceMesh& mesh = *dist_.mesh;
      for (size_t i = 0; i < squared_norms.size(); ++i) {
        const Trainable& t = trainables_[i];
        const double holders = double(mesh.size()) * double(t.held().local_size()) / double(t.held().full_size());
        squared_norms[i] /= holders;
      }
      mesh.comm().all_reduce_sum(squared_norms);
    };
}

// ---- placement on the mesh --------------------------------------------------------------------

void Trainer::place_variables() {
  for (const Parameter& p : params_) {
    Trainable t;
    t.value = p.value;
    t.grad = p.grad;
    t.size = t.whole_size = p.size;
    trainables_.push_back(std::move(t));
  }
  if (!dist_.mesh) return;
  // Working copies, gradients, blocks and the optimizer's slots are the backend's memory. Cutting
  // and placing blocks is host work (HostStaging: a GPU's values are staged through host copies
  // for it); gradients of working copies are summed where they are (NCCL on a mesh of GPUs).
  const bool on_device = backend_->device() != Device::Host;
  DeviceMesh& mesh = *dist_.mesh;
  plan_ = plan_tensor_parallel(config_, dist_.layout, mesh, dist_.batch_axis, dist_.tensor_parallel);
  if (lora_) {
    // The frozen base: blocks of the split variables only. LoRA matrices are used whole (in their
    // own, Keras, layout); under tensor parallelism each process' gradient is its heads' share.
    frozen_ = ShardedModel(std::move(model_), dist_.layout, mesh, plan_);
    model_ = frozen_.replicated_part();
    for (size_t i = 0; i < lora_->adapters.size(); ++i) {
      const LoraAdapter& ad = lora_->adapters[i];
      for (int which = 0; which < 2; ++which) {
        Trainable& t = trainables_[2 * i + size_t(which)];
        const Shape& shape = which == 0 ? ad.a_shape : ad.b_shape;
        t.region = whole_shard_spec(right_aligned_dimensions(shape.size()), shape);
        t.shard = make_shard_spec(right_aligned_dimensions(shape.size()), shape,
                                  dist_.layout.resolve(params_[2 * i + size_t(which)].path, shape, mesh), mesh);
        t.partial = plan_.active();
        if (t.separate()) {  // a layout map that splits LoRA matrices: the block is cut from the whole
          HostStaging host(*backend_);
          backend_->resize(t.block, size_t(t.shard.local_size()));
          take_block(host.read(t.value).data, relative(t.shard, t.region), host.write(t.block).data);
          host.flush();
        }
      }
    }
  } else {
    // Full fine-tuning: every variable's block (the optimizer's) and fp32 working copy (its compute
    // region), read from the stored weights — or from the block sharded loading left there.
    const auto specs = gemma_variables(config_);
    for (size_t i = 0; i < specs.size(); ++i) {
      const VariableSpec& spec = specs[i];
      Trainable& t = trainables_[i];
      t.shard = make_shard_spec(our_dimensions(spec.kind), spec.keras_shape,
                                dist_.layout.resolve(spec.keras_path, spec.keras_shape, mesh), mesh);
      t.region = plan_.compute_region(spec);
      t.partial = plan_.gradient_is_partial(spec);
      std::vector<float> working, block;
      if (holds_only_block(model_, spec, t.shard)) {
        block = variable_values(model_, spec);
        working = gather_region(block.data(), t.shard, t.region, mesh);
      } else {
        if (t.separate()) block = read_block(model_, spec, t.shard);
        working = read_block(model_, spec, t.region);
      }
      if (t.separate()) {
        backend_->resize(t.block, block.size());
        backend_->upload(block, t.block);
      }
      set_variable(model_, spec, t.region, std::move(working));
      if (on_device) make_trainable_copy(*backend_, model_, spec);  // the working copy in the device's memory
      SlotRef ref = slot_ref(model_, grads_, spec);
      t.value = ref.value;
      t.grad = gradient_storage(i, ref.size, ref.grad);
      t.size = ref.size;
    }
    model_.config = plan_.local_config(config_);
    if (plan_.active()) model_.vocab_offset = plan_.vocab_offset(config_);
  }
  // The optimizer sees blocks where they are separate, else the working copies.
  for (size_t i = 0; i < params_.size(); ++i) {
    Trainable& t = trainables_[i];
    const ShardSpec& held = t.held();
    if (t.separate()) backend_->resize_zeroed(t.block_grad, t.block.size());
    params_[i].value = t.separate() ? Floats(t.block) : t.value;
    params_[i].grad = t.separate() ? Floats(t.block_grad) : t.grad;
    params_[i].size = size_t(held.local_size());
    if (held.local_size() != held.full_size()) params_[i].shape = {held.local[0], held.local[1], held.local[2]};
  }
}

void Trainer::refresh_working_copy(Trainable& t) {
  if (!t.separate()) return;
  HostStaging host(*backend_);
  const std::vector<float> values = gather_region(host.read(t.block).data, t.shard, t.region, *dist_.mesh);
  std::copy(values.begin(), values.end(), host.write(t.value.part(0, t.size)).data);
  host.flush();
}

size_t Trainer::held_weight_bytes() const {
  if (lora_) return dist_.mesh ? frozen_.held_bytes() : model_.weight_bytes();
  size_t bytes = 0;  // full fine-tuning: the working copies, and the blocks the optimizer owns
  for (const Trainable& t : trainables_) bytes += (t.size + t.block.size()) * 4;
  return bytes;
}

Batch Trainer::local_rows(const Batch& batch) const {
  if (!dist_.mesh) return batch;
  const int axis = dist_.mesh->axis_index(dist_.batch_axis);
  if (axis < 0 || dist_.mesh->axis_size(axis) == 1) return batch;
  const int64_t parts = dist_.mesh->axis_size(axis), c = dist_.mesh->coordinate(axis);
  check(batch.batch_size % parts == 0, "batch of ", batch.batch_size, " examples is not divisible by the '",
        dist_.batch_axis, "' mesh axis of size ", parts, " (choose --batch-size as a multiple of it)");
  const int64_t rows = batch.batch_size / parts, L = batch.seq_len;
  Batch local;
  local.batch_size = rows;
  local.seq_len = L;
  auto slice = [&](const auto& v) { return std::vector(v.begin() + c * rows * L, v.begin() + (c + 1) * rows * L); };
  local.token_ids = slice(batch.token_ids);
  local.padding_mask = slice(batch.padding_mask);
  local.targets = slice(batch.targets);
  local.sample_weight = slice(batch.sample_weight);
  return local;
}

// The dimension of `t`'s working copy that its block splits over mesh axis `axis` — when that is
// the only split between them (then a reduce-scatter over the axis yields the block directly) — else -1.
static int only_split_by(const ShardSpec& region, const ShardSpec& shard, int axis) {
  if (!contains(region, shard)) return -1;
  const ShardSpec inside = relative(shard, region);
  int dim = -1;
  for (int d = 0; d < 3; ++d) {
    if (inside.axis[size_t(d)] < 0) continue;
    if (inside.axis[size_t(d)] != axis || dim >= 0) return -1;
    dim = d;
  }
  return dim;
}

void Trainer::finish_gradients(LossSums& sums) {
  if (!dist_.mesh) return;
  const int axis = dist_.mesh->axis_index(dist_.batch_axis);
  Communicator* batch = axis >= 0 && dist_.mesh->axis_size(axis) > 1 ? &dist_.mesh->axis_comm(axis) : nullptr;
  // Gradients whose block splits the working copy over the batch axis only are reduce-scattered
  // (FSDP-style: each process receives just its block's sums); the others are all-reduced.
  std::vector<int> scatter_dim(trainables_.size(), -1);
  if (batch) {
    double s[3] = {sums.weighted_ce, sums.weighted_correct, sums.weight};
    batch->all_reduce_sum({s, 3});
    sums = {s[0], s[1], s[2]};
    std::vector<Floats> grads;
    for (size_t i = 0; i < trainables_.size(); ++i) {
      Trainable& t = trainables_[i];
      scatter_dim[i] = t.separate() ? only_split_by(t.region, t.shard, axis) : -1;
      if (scatter_dim[i] < 0) grads.push_back(t.grad.part(0, t.size));
    }
    all_reduce_sum_bucketed(*batch, grads);
  }
  Communicator* tensor_parallel = plan_.active() ? &dist_.mesh->axis_comm(plan_.axis) : nullptr;
  if (tensor_parallel) {  // partial gradients of parts this process holds whole: one bucketed sum
    std::vector<Floats> partial;
    for (Trainable& t : trainables_)
      if (t.partial && contains(t.region, t.shard)) partial.push_back(t.grad.part(0, t.size));
    all_reduce_sum_bucketed(*tensor_parallel, partial);
  }
  for (size_t i = 0; i < trainables_.size(); ++i) {
    Trainable& t = trainables_[i];
    if (!t.separate()) continue;  // the optimizer updates the working copy, summed above
    HostStaging host(*backend_);
    const float* grad = host.read(t.grad.part(0, t.size)).data;
    float* block_grad = host.write(t.block_grad).data;
    if (tensor_parallel && !contains(t.region, t.shard)) {
      // The block reaches beyond this process' part (e.g. a replicated K/V kernel of which each
      // process uses its heads): assemble the whole gradient from every process' part.
      std::vector<float> whole(static_cast<size_t>(t.shard.full_size()), 0.f);
      place_block(grad, t.region, whole.data());
      tensor_parallel->all_reduce_sum(whole);
      take_block(whole.data(), t.shard, block_grad);
    } else if (scatter_dim[i] >= 0) {
      // Every member's block, in member order, then one reduce-scatter.
      ShardSpec member = relative(t.shard, t.region);
      const size_t count = size_t(member.local_size());
      std::vector<float> blocks(count * size_t(batch->size()));
      for (int m = 0; m < batch->size(); ++m) {
        member.offset[size_t(scatter_dim[i])] = member.local[size_t(scatter_dim[i])] * m;
        take_block(grad, member, blocks.data() + count * size_t(m));
      }
      batch->reduce_scatter_sum(blocks, {block_grad, count});
    } else {
      take_block(grad, relative(t.shard, t.region), block_grad);
    }
    host.flush();
  }
}

void Trainer::apply_update(double lr) {
  optimizer_->step(params_, lr);
  ++step_;
  if (!dist_.mesh) return;
  for (Trainable& t : trainables_) refresh_working_copy(t);
}

const std::optional<LoraWeights>& Trainer::lora() const {
  if (lora_) lora_tensors_.download(*backend_, *lora_);
  return lora_;
}

GemmaModel Trainer::current_model() {
  if (lora_) return merge_lora(frozen_.has_split() ? frozen_.materialize() : model_, *lora());
  if (backend_->device() == Device::Host && !plan_.active()) return model_;  // whole working copies
  // Each variable in host memory: its whole working copy downloaded, or under tensor parallelism
  // gathered from every process' part.
  GemmaModel m = model_;
  m.config = config_;
  m.vocab_offset = 0;
  const auto specs = gemma_variables(config_);
  for (size_t i = 0; i < specs.size(); ++i) {
    Trainable& t = trainables_[i];
    std::vector<float> whole(t.whole_size);
    if (!plan_.active()) {
      backend_->download(t.value.part(0, t.size), whole);
    } else {
      HostStaging host(*backend_);
      gather_full(host.read(t.separate() ? Floats(t.block) : t.value).data, t.shard, *dist_.mesh, whole.data());
    }
    set_variable(m, specs[i], std::move(whole));
  }
  return m;
}

Context Trainer::context() const {
  return Context{*backend_, precision_,
                 TensorParallelGroup(plan_.active() ? &dist_.mesh->axis_comm(plan_.axis) : nullptr)};
}

const GemmaModel& Trainer::training_model() {
  // The frozen base as computed here (under a mesh: this process' heads/FFN columns, the other
  // split variables all-gathered one block at a time as the passes reach them), with the adapters
  // as low-rank terms: nothing is merged.
  if (!training_model_) {
    if (!dist_.mesh) training_model_ = model_;
    // On a device the compute model is made whole on the host (no per-layer gathers in the passes)
    // and uploaded once.
    else if (backend_->device() != Device::Host) training_model_ = upload_model(frozen_.compute_model(false), *backend_);
    else training_model_ = frozen_.compute_model(/*by_layer=*/true);
    attach_lora(*training_model_, *lora_, lora_tensors_, config_, plan_);
  }
  return *training_model_;
}

GemmaModel Trainer::inference_model() {
  // Over an int8 base the adapters stay low-rank terms, as in Keras (merging would re-quantize).
  // So do they on a device backend: merging reads the weights on the host.
  if (lora_ && (int8_base_ || backend_->device() != Device::Host)) return training_model();
  if (!lora_) return model_;  // the working copies (this process' parts under tensor parallelism)
  if (!dist_.mesh) return current_model();
  return merge_lora_parts(frozen_.compute_model(/*by_layer=*/false), *lora(), config_, plan_);
}

}  // namespace meshtune
