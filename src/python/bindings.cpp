// The Python extension `meshtune._meshtune`: the library API (api/causal_lm.h) as plain functions
// over Python strings, numbers, lists and dicts. The package around it (python/meshtune) gives it
// Keras' and KerasHub's names and checks the types of what a script passes; this layer converts,
// releases the GIL while C++ works, and turns C++ errors into Python exceptions carrying the same
// one-line message (meshtune::FileNotFound → FileNotFoundError, other meshtune::Error → ValueError,
// std::bad_alloc → MemoryError, anything else → RuntimeError).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <Python.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "api/causal_lm.h"
#include "backend/cpu/blas_kernels.h"
#include "backend/cuda_devices.h"
#include "core/error.h"
#include "data/dataset.h"
#include "distribution/communicator.h"
#include "distribution/layout.h"
#include "train/training_log.h"

namespace py = pybind11;
using namespace meshtune;

namespace {

// Reads dict entries by name, refusing names it was not asked about (a misspelt option is an error,
// not silently ignored).
class Options {
 public:
  explicit Options(const py::dict& d, std::string what) : what_(std::move(what)) {
    for (const auto& [key, value] : d) entries_.emplace_back(py::cast<std::string>(key), py::reinterpret_borrow<py::object>(value));
  }
  template <class T>
  void get(const char* name, T& out) {
    for (auto& [key, value] : entries_)
      if (key == name) {
        used_.push_back(key);
        if (!value.is_none()) out = value.template cast<T>();
      }
  }
  void done() const {
    for (const auto& [key, value] : entries_)
      if (std::find(used_.begin(), used_.end(), key) == used_.end())
        throw py::type_error(what_ + ": unknown option '" + key + "'");
  }

 private:
  std::string what_;
  std::vector<std::pair<std::string, py::object>> entries_;
  std::vector<std::string> used_;
};

api::DistributionOptions distribution_options(const py::dict& d) {
  api::DistributionOptions o;
  Options in(d, "distribution");
  in.get("mesh_shape", o.mesh_shape);
  in.get("axis_names", o.axis_names);
  in.get("layout", o.layout);
  in.get("batch_axis", o.batch_axis);
  in.get("tensor_parallel", o.tensor_parallel);
  std::vector<std::pair<std::string, std::vector<std::optional<std::string>>>> rules;
  in.get("rules", rules);
  in.done();
  for (const auto& [regex, spec] : rules) o.layout_map.add(regex, spec);
  return o;
}

api::PresetOptions preset_options(const py::dict& d) {
  api::PresetOptions o;
  Options in(d, "from_preset");
  in.get("models_dir", o.models_dir);
  in.get("dtype_policy", o.dtype_policy);
  in.get("quantize", o.quantize);
  in.get("fp32_weights", o.fp32_weights);
  in.get("lora", o.lora);
  in.get("train_all_weights", o.train_all_weights);
  in.get("need_tokenizer", o.need_tokenizer);
  in.get("backend", o.backend);
  py::dict distribution;
  in.get("distribution", distribution);
  in.done();
  o.distribution = distribution_options(distribution);
  return o;
}

api::CompileOptions compile_options(const py::dict& d) {
  api::CompileOptions o;
  Options in(d, "compile");
  in.get("learning_rate", o.learning_rate);
  in.get("weight_decay", o.weight_decay);
  in.get("beta_1", o.beta_1);
  in.get("beta_2", o.beta_2);
  in.get("epsilon", o.epsilon);
  in.get("exclude_from_weight_decay", o.exclude_from_weight_decay);
  in.get("clipnorm", o.clipnorm);
  in.get("clipvalue", o.clipvalue);
  in.get("global_clipnorm", o.global_clipnorm);
  in.get("schedule", o.schedule);
  in.get("warmup_steps", o.warmup_steps);
  in.get("final_lr_fraction", o.final_lr_fraction);
  in.done();
  return o;
}

api::FitRunOptions run_options(const py::dict& d) {
  api::FitRunOptions o;
  Options in(d, "fit");
  in.get("epochs", o.epochs);
  in.get("steps", o.steps);
  in.get("batch_size", o.batch_size);
  in.get("sequence_length", o.sequence_length);
  in.get("grad_accumulation", o.grad_accumulation);
  in.get("take", o.take);
  in.get("shuffle", o.shuffle);
  in.get("shuffle_seed", o.shuffle_seed);
  in.get("train_on_all_turns", o.train_on_all_turns);
  in.get("checkpoint_path", o.checkpoint_path);
  in.get("checkpoint_every", o.checkpoint_every);
  in.get("resume", o.resume);
  in.done();
  return o;
}

GenerateOptions generate_options(const api::GemmaCausalLM& lm, const py::dict& d) {
  GenerateOptions o = lm.default_generate_options();
  Options in(d, "generate");
  in.get("max_length", o.max_length);
  in.get("stop_token_ids", o.stop_token_ids);
  in.get("sampler", o.sampler.name);
  in.get("top_k", o.sampler.top_k);
  in.get("top_p", o.sampler.top_p);
  in.get("temperature", o.sampler.temperature);
  std::optional<uint64_t> seed;
  in.get("seed", seed);
  in.done();
  if (seed) o.sampler.seeded = true, o.sampler.seed = *seed;
  return o;
}

py::dict step_logs(const StepReport& r) {
  py::dict logs;
  logs["step"] = r.step;
  logs["epoch"] = r.epoch;
  logs["step_in_epoch"] = r.step_in_epoch;
  logs["epoch_steps"] = r.epoch_steps;
  logs["batch_loss"] = r.loss;
  logs["loss"] = r.epoch_loss;
  logs["sparse_categorical_accuracy"] = r.accuracy;
  logs["learning_rate"] = r.learning_rate;
  logs["tokens_per_s"] = r.tokens_per_s;
  logs["ms_per_step"] = r.ms_per_step;
  return logs;
}

// fit()'s events handed to a Python function handler(event, data) between steps, with the GIL
// taken for the call. A Python exception there (a callback that raises, or Ctrl-C: the signal
// handlers run here) stops the run after the current step and is raised again when fit returns.
class PythonEvents : public TrainingLog {
 public:
  PythonEvents(py::object handler, api::GemmaCausalLM& lm) : handler_(std::move(handler)), lm_(lm) {}
  void run_begin(int64_t first_step, int64_t total_steps, int epochs) override {
    call("train_begin", [&] {
      py::dict d;
      d["first_step"] = first_step, d["total_steps"] = total_steps, d["epochs"] = epochs;
      return d;
    });
  }
  void epoch_begin(int64_t epoch, int epochs, int64_t steps) override {
    call("epoch_begin", [&] {
      py::dict d;
      d["epoch"] = epoch, d["epochs"] = epochs, d["steps"] = steps;
      return d;
    });
  }
  void step_end(const StepReport& report) override {
    call("step_end", [&] { return step_logs(report); });
  }
  void checkpoint_saved(int64_t step, const std::string& path) override {
    call("checkpoint_saved", [&] {
      py::dict d;
      d["step"] = step, d["path"] = path;
      return d;
    });
  }
  void run_end(bool interrupted) override {
    call("train_end", [&] {
      py::dict d;
      d["interrupted"] = interrupted;
      return d;
    });
  }
  // The first Python exception raised during the run, if any.
  std::optional<py::error_already_set>& error() { return error_; }

 private:
  template <class MakeData>
  void call(const char* event, MakeData make_data) {
    py::gil_scoped_acquire gil;
    if (error_) return;
    try {
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (!handler_.is_none()) handler_(event, make_data());
    } catch (py::error_already_set& e) {
      error_.emplace(std::move(e));
      lm_.stop_training();
    }
  }
  py::object handler_;
  api::GemmaCausalLM& lm_;
  std::optional<py::error_already_set> error_;
};

py::dict history_dict(const api::History& h) {
  py::dict d;
  d["loss"] = h.loss;
  d["sparse_categorical_accuracy"] = h.accuracy;
  d["steps"] = h.steps;
  d["interrupted"] = h.interrupted;
  d["train_seconds"] = h.train_seconds;
  d["trainable_params"] = h.trainable_params;
  return d;
}

py::dict config_dict(const GemmaConfig& c) {
  py::dict d;
  d["family"] = c.family;
  d["vocabulary_size"] = c.vocab_size;
  d["num_layers"] = c.num_layers;
  d["num_query_heads"] = c.num_query_heads;
  d["num_key_value_heads"] = c.num_key_value_heads;
  d["hidden_dim"] = c.hidden_dim;
  d["intermediate_dim"] = c.ffw_dim;
  d["head_dim"] = c.head_dim;
  d["max_sequence_length"] = c.max_sequence_length;
  d["num_parameters"] = c.num_parameters();
  d["int8"] = !c.int8_layers.empty();
  return d;
}

Dataset make_dataset(std::vector<std::string> texts, std::vector<std::string> responses,
                     const std::vector<std::vector<std::pair<std::string, std::string>>>& conversations,
                     std::vector<std::vector<int32_t>> token_rows, std::string source) {
  Dataset d;
  d.source = std::move(source);
  d.texts = std::move(texts);
  d.responses = std::move(responses);
  d.token_rows = std::move(token_rows);
  for (const auto& conversation : conversations) {
    std::vector<ChatMessage> messages;
    for (const auto& [role, content] : conversation) messages.push_back({role, content});
    d.conversations.push_back(std::move(messages));
  }
  check(d.size() > 0, d.source, ": no examples to train on");
  check(d.responses.empty() || d.responses.size() == d.texts.size(), d.source,
        ": every prompt needs a response (", d.texts.size(), " prompts, ", d.responses.size(), " responses)");
  return d;
}

}  // namespace

PYBIND11_MODULE(_meshtune, m) {
  m.doc() = "meshtune's C++ engine; use the meshtune package, which gives it Keras' names";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const FileNotFound& e) {
      PyErr_SetString(PyExc_FileNotFoundError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "out of memory");
    }
  });

  m.def("world_size", [] { return world().size(); }, "Processes in this job (mpirun -np N, else 1)");
  m.def("world_rank", [] { return world().rank(); }, "This process' rank in the job");
  m.def("partition_spec_str", &partition_spec_str);
  m.def("gpu_count", [] { return int(cuda_system().gpus.size()); },
        "NVIDIA GPUs this process can compute on (0 without a GPU, driver or CUDA build)");
  // OpenBLAS' kernel family is chosen before the engine loads (meshtune/_engine.py), by a child
  // Python that calls _blas_kernels_to_use, which times the families in children calling _time_sgemm.
  m.def("_time_sgemm", [] { time_sgemm_if_asked(); });
  m.def("_blas_kernels_to_use", [](const std::vector<std::string>& timing_command) {
    py::gil_scoped_release release;
    const BlasChoice choice = blas_kernels_to_use(timing_command);
    return std::make_pair(choice.core, choice.note);
  });
  m.def("_blas_kernel_choice", &blas_kernel_choice);

  py::class_<Dataset>(m, "Dataset")
      .def(py::init(&make_dataset), py::arg("texts"), py::arg("responses"), py::arg("conversations"),
           py::arg("token_rows"), py::arg("source"))
      .def_static(
          "load",
          [](const std::string& spec, const std::string& text_field, const std::string& prompt_field,
             const std::string& response_field) {
            py::gil_scoped_release release;
            return load_dataset(spec, DataFields{text_field, prompt_field, response_field});
          },
          py::arg("spec"), py::arg("text_field") = "text", py::arg("prompt_field") = "prompts",
          py::arg("response_field") = "responses")
      .def("__len__", &Dataset::size)
      .def_readonly("source", &Dataset::source);

  py::class_<api::GemmaCausalLM>(m, "CausalLM")
      .def_static(
          "from_preset",
          [](const std::string& preset, const py::dict& options) {
            const api::PresetOptions o = preset_options(options);
            py::gil_scoped_release release;
            return api::GemmaCausalLM::from_preset(preset, o);
          },
          py::arg("preset"), py::arg("options"))
      .def_property_readonly("config", [](const api::GemmaCausalLM& lm) { return config_dict(lm.config()); })
      .def_property("sequence_length", &api::GemmaCausalLM::sequence_length, &api::GemmaCausalLM::set_sequence_length)
      .def_property_readonly("is_main_process", &api::GemmaCausalLM::is_main_process)
      .def_property_readonly("has_tokenizer", &api::GemmaCausalLM::has_tokenizer)
      .def("distribution_summary", &api::GemmaCausalLM::distribution_summary)
      .def("variables",
           [](const api::GemmaCausalLM& lm) {
             py::list out;
             for (const api::VariableInfo& v : lm.variables()) {
               py::dict d;
               d["path"] = v.path;
               d["shape"] = py::tuple(py::cast(v.shape));
               d["dtype"] = dtype_name(v.dtype);
               d["trainable"] = v.trainable;
               d["sharding"] = v.sharding;
               out.append(d);
             }
             return out;
           })
      .def("summary",
           [](const api::GemmaCausalLM& lm) {
             const api::ParameterSummary s = lm.summary();
             py::dict d;
             d["total"] = s.total, d["trainable"] = s.trainable, d["non_trainable"] = s.non_trainable;
             d["total_bytes"] = s.total_bytes, d["trainable_bytes"] = s.trainable_bytes;
             d["non_trainable_bytes"] = s.non_trainable_bytes;
             return d;
           })
      .def(
          "enable_lora",
          [](api::GemmaCausalLM& lm, int rank, std::vector<std::string> targets, double alpha, uint64_t seed) {
            lm.enable_lora({rank, std::move(targets), alpha, seed});
          },
          py::arg("rank"), py::arg("targets"), py::arg("alpha"), py::arg("seed"))
      .def("load_lora_weights", &api::GemmaCausalLM::load_lora_weights, py::call_guard<py::gil_scoped_release>())
      .def("save_lora_weights", &api::GemmaCausalLM::save_lora_weights, py::call_guard<py::gil_scoped_release>())
      .def("save_peft_adapter", &api::GemmaCausalLM::save_peft_adapter, py::call_guard<py::gil_scoped_release>())
      .def("keras_lora_layout", &api::GemmaCausalLM::keras_lora_layout)
      .def_property_readonly("lora_rank", [](const api::GemmaCausalLM& lm) { return lm.lora() ? lm.lora()->rank : 0; })
      .def(
          "generate",
          [](const api::GemmaCausalLM& lm, const std::vector<std::string>& prompts, const py::dict& options) {
            const GenerateOptions o = generate_options(lm, options);
            std::vector<GeneratedText> results;
            {
              py::gil_scoped_release release;
              results = lm.generate(prompts, o);
            }
            py::list out;
            for (const GeneratedText& r : results) {
              py::dict d;
              d["text"] = r.text;
              d["completion"] = r.completion;
              d["token_ids"] = r.token_ids;
              d["prompt_length"] = r.prompt_length;
              out.append(d);
            }
            return out;
          },
          py::arg("prompts"), py::arg("options"))
      .def(
          "logits",
          [](const api::GemmaCausalLM& lm, const std::vector<int32_t>& ids, const std::vector<int32_t>& mask, int64_t B,
             int64_t T) {
            check(B >= 1 && T >= 1 && int64_t(ids.size()) == B * T, "logits: token_ids must be a [batch, length] array");
            const int64_t V = lm.config().vocab_size;
            std::vector<float> logits(size_t(B * T * V));
            {
              py::gil_scoped_release release;
              lm.logits(ids, mask, B, T, nullptr, logits.data());
            }
            return py::bytes(reinterpret_cast<const char*>(logits.data()), logits.size() * sizeof(float));
          },
          py::arg("token_ids"), py::arg("padding_mask"), py::arg("batch"), py::arg("length"))
      .def("compile", [](api::GemmaCausalLM& lm, const py::dict& options) { lm.compile(compile_options(options)); })
      .def(
          "fit",
          [](api::GemmaCausalLM& lm, const Dataset& data, const py::dict& options, py::object handler, bool progress) {
            const api::FitRunOptions run = run_options(options);
            PythonEvents events(std::move(handler), lm);
            ProgressLog bar(stderr);
            std::vector<api::Callback*> callbacks = {&events};
            if (progress && lm.is_main_process()) callbacks.insert(callbacks.begin(), &bar);
            api::History history;
            {
              py::gil_scoped_release release;
              history = lm.fit(data, run, callbacks);
            }
            if (events.error()) throw std::move(*events.error());
            return history_dict(history);
          },
          py::arg("data"), py::arg("options"), py::arg("handler"), py::arg("progress"))
      .def(
          "evaluate",
          [](const api::GemmaCausalLM& lm, const Dataset& data, const py::dict& options) {
            const api::FitRunOptions run = run_options(options);
            py::gil_scoped_release release;
            const EpochMetrics metrics = lm.evaluate(data, run);
            return std::make_pair(metrics.loss, metrics.accuracy);
          },
          py::arg("data"), py::arg("options"))
      .def("stop_training", &api::GemmaCausalLM::stop_training)
      .def("trainable_count", &api::GemmaCausalLM::trainable_count)
      .def("save_to_preset", &api::GemmaCausalLM::save_to_preset, py::call_guard<py::gil_scoped_release>())
      .def("export", &api::GemmaCausalLM::export_model, py::call_guard<py::gil_scoped_release>());
}
