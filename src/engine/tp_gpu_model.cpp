#include "engine/tp_gpu_model.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "core/error.h"
#include "core/kv_tree.h"
#include "cuda/backend.h"
#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "cuda/p2p_all_reduce.h"
#include "engine/gpu_weights.h"
#include "engine/tp_shard.h"
#include "plan/planner.h"

namespace fasttree {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

std::string what_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const Error& x) {
    return x.message();
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

// One persistent thread with its device made current once; runs one posted task at a time.
class RankWorker {
 public:
  explicit RankWorker(int device) : thread_([this, device] { loop(device); }) {}
  ~RankWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  RankWorker(const RankWorker&) = delete;
  RankWorker& operator=(const RankWorker&) = delete;

  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = std::move(task);
      pending_ = true;
    }
    cv_.notify_all();
  }
  // Waits for the posted task; returns its exception (nullptr when it finished).
  std::exception_ptr wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return !pending_; });
    return std::exchange(error_, nullptr);
  }

 private:
  void loop(int device) {
    std::exception_ptr device_error;
    try {
      cuda_set_device(device);
    } catch (...) {
      device_error = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return pending_ || stop_; });
      if (!pending_) return;  // stop
      std::function<void()> task = std::move(task_);
      lock.unlock();
      std::exception_ptr err = device_error;
      if (!err) {
        try {
          task();
        } catch (...) {
          err = std::current_exception();
        }
      }
      task = nullptr;
      lock.lock();
      error_ = err;
      pending_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> task_;
  bool pending_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts after the members above exist
};

using Clock = std::chrono::steady_clock;

}  // namespace

struct TpGpuModel::Impl {
  ModelConfig config;
  ModelConfig local;
  TpGpuModelOptions options;
  int tp = 1;
  std::vector<int> devices;
  std::vector<std::unique_ptr<NcclComm>> comms;
  std::vector<std::unique_ptr<P2pAllReduce>> p2p;  // empty unless the one-shot all-reduce is on
  std::vector<std::unique_ptr<RankWorker>> workers;
  std::vector<std::unique_ptr<GpuModel>> ranks;
  std::vector<std::atomic<bool>> device_failed;
  std::vector<std::string> rank_errors;
  std::string broken;  // first failure in device work: the model is unusable
  int32_t num_slots = 0;
  Planner planner;
  Plan plan;
  DecodeTimes times;  // steps / total_ms of whole calls
  int64_t replica_mismatches = 0;
  std::vector<std::vector<int32_t>> greedy;  // [tp] each rank's tokens of the current call
  std::string reduce_path;

  Impl(const ModelConfig& whole, TpGpuModelOptions opt)
      : config(whole), options(std::move(opt)), tp(options.tp), device_failed(static_cast<size_t>(std::max(1, options.tp))),
        planner(options.model.planner) {
    config.validate();
    check_tp(config, tp);  // heads / intermediate size split (no device needed)
    local = tp_local_config(config, tp);
    FT_CHECK(options.timeout.count() > 0, "tensor parallelism: the timeout must be positive");
    FT_CHECK(cuda_backend_built(), "tensor parallelism on GPUs: this binary was built without the CUDA backend (no nvcc)");
    devices = options.devices;
    if (devices.empty())
      for (int r = 0; r < tp; ++r) devices.push_back(r);
    FT_CHECK(static_cast<int>(devices.size()) == tp,
             "tensor parallelism: " + str(static_cast<int64_t>(devices.size())) + " devices given for tp " + str(tp));
    const int visible = cuda_device_count();
    for (int r = 0; r < tp; ++r)
      FT_CHECK(devices[static_cast<size_t>(r)] >= 0 && devices[static_cast<size_t>(r)] < visible,
               "tensor parallelism: tp " + str(tp) + " needs " + str(tp) + " GPUs, but rank " + str(r) + "'s device " +
                   str(devices[static_cast<size_t>(r)]) + " is missing (" + str(visible) + " CUDA device" +
                   (visible == 1 ? "" : "s") + " visible)");
    FT_CHECK(nccl_available(), "tensor parallelism on GPUs: this binary was built without NCCL");
    rank_errors.assign(static_cast<size_t>(tp), "");
    greedy.resize(static_cast<size_t>(tp));
    // Communicators first: NCCL's buffers must not find the devices filled by the KV pools.
    comms = NcclComm::create_group(devices, options.timeout);
    choose_all_reduce();
    for (int r = 0; r < tp; ++r) workers.push_back(std::make_unique<RankWorker>(devices[static_cast<size_t>(r)]));
    ranks.resize(static_cast<size_t>(tp));
  }

  // How the all-reduces run (TpGpuModelOptions::p2p_all_reduce, symmetric_windows): the P2P
  // one-shot group, else NCCL symmetric windows, else plain NCCL; reduce_path says which and why.
  // Either buffer holds the row-parallel outputs of a call of up to max(prefill_chunk,
  // kTpWindowMinRows) rows (the P2P one at most kTpP2pMaxBytes).
  void choose_all_reduce() {
    const size_t rows_bytes = static_cast<size_t>(std::max<int64_t>(options.model.prefill_chunk, kTpWindowMinRows)) *
                              static_cast<size_t>(config.hidden_size) * 4;
    const char* p2p_env = std::getenv("FT_TP_P2P");
    const bool want_p2p = p2p_env != nullptr ? std::string(p2p_env) != "0" : options.p2p_all_reduce;
    std::string no_p2p;  // why the P2P group was wanted but not made
    if (want_p2p) {
      p2p = P2pAllReduce::create_group(devices, std::min(kTpP2pMaxBytes, rows_bytes), options.timeout, &no_p2p);
      if (!p2p.empty()) {
        reduce_path = "p2p one-shot up to " + str(static_cast<int64_t>(p2p[0]->buffer_bytes() >> 10)) + " KiB, nccl above";
        return;
      }
      no_p2p = "; no p2p: " + no_p2p;
    }
    const char* env = std::getenv("FT_NCCL_SYMMETRIC");
    if (!options.symmetric_windows || (env != nullptr && std::string(env) == "0")) {
      reduce_path = "nccl (symmetric windows off" + no_p2p + ")";
      return;
    }
    std::string why;
    try {
      why = NcclComm::create_symmetric_windows(comms, rows_bytes);
    } catch (const Error& e) {  // registration failed half-way: the group was aborted, make a new one
      why = e.message();
      NcclComm::destroy_group(comms);
      comms = NcclComm::create_group(devices, options.timeout);
    }
    if (why.empty()) {
      reduce_path = "nccl symmetric windows (" + str(static_cast<int64_t>(comms[0]->window_bytes() >> 20)) +
                    " MiB per rank" + no_p2p + ")";
    } else {
      reduce_path = "nccl (no symmetric windows: " + why + no_p2p + ")";
    }
  }

  ~Impl() {
    // Each rank's model is destroyed on its own thread (its device current), then the communicators.
    if (!workers.empty()) {
      for (int r = 0; r < tp && r < static_cast<int>(workers.size()); ++r)
        workers[static_cast<size_t>(r)]->post([this, r] { ranks[static_cast<size_t>(r)].reset(); });
      for (auto& w : workers) (void)w->wait();
    }
    NcclComm::destroy_group(comms);
    workers.clear();  // joins
  }

  GpuModelOptions rank_options(int r) {
    GpuModelOptions o = options.model;
    o.device = devices[static_cast<size_t>(r)];
    o.tp_rank = r;
    o.tp_size = tp;
    NcclComm* comm = comms[static_cast<size_t>(r)].get();
    P2pAllReduce* one_shot = p2p.empty() ? nullptr : p2p[static_cast<size_t>(r)].get();
    const auto timeout = options.timeout;
    o.tp.all_reduce = [comm, one_shot](float* data, size_t count, CUstream_st* stream) {
      if (one_shot != nullptr && one_shot->accepts(data, count)) {
        one_shot->all_reduce_sum_fp32(data, count, stream);
      } else {
        comm->all_reduce_sum_fp32(data, count, stream);
      }
    };
    o.tp.wait = [comm, one_shot, timeout](CUstream_st* stream) {
      comm->wait(stream, timeout);
      if (one_shot != nullptr) one_shot->check();
    };
    o.tp.on_error = [this, comm, one_shot, r] {
      device_failed[static_cast<size_t>(r)].store(true);
      if (one_shot != nullptr) one_shot->abort();  // peers' kernels waiting for this rank give up
      comm->abort();  // this rank's thread owns the communicator
    };
    if (one_shot != nullptr) {
      o.tp.reduce_buffer = one_shot->buffer();
      o.tp.reduce_buffer_bytes = one_shot->buffer_bytes();
    } else {
      o.tp.reduce_buffer = static_cast<float*>(comm->window());
      o.tp.reduce_buffer_bytes = comm->window_bytes();
    }
    if (options.before_all_reduce) {
      auto hook = options.before_all_reduce;
      o.tp.before_all_reduce = [hook, r](int64_t index) { hook(r, index); };
    }
    return o;
  }

  // Builds every rank's model in parallel; make(r, options) runs on rank r's thread.
  void build(int32_t slots, const std::function<std::unique_ptr<GpuModel>(int, int32_t, const GpuModelOptions&)>& make,
             int64_t weight_bytes) {
    FT_CHECK(slots >= 0, "tensor parallelism: num_slots must be >= 0, got " + str(slots));
    if (slots == 0) {  // the largest pool every rank holds
      std::vector<int64_t> fit(static_cast<size_t>(tp), 0);
      run([&](int r) {
        const int64_t free_after = static_cast<int64_t>(cuda_mem_info().free_bytes) - weight_bytes;
        fit[static_cast<size_t>(r)] = gpu_max_kv_slots(local, std::max<int64_t>(0, free_after),
                                                       options.model.kv_memory_fraction, options.model.prefill_chunk);
      }, false);
      slots = static_cast<int32_t>(*std::min_element(fit.begin(), fit.end()));
      FT_CHECK(slots > 0, "tensor parallelism: no room for a KV pool on some rank after its " + str(weight_bytes) +
                              " bytes of weights");
    }
    run([&](int r) { ranks[static_cast<size_t>(r)] = make(r, slots, rank_options(r)); }, false);
    num_slots = ranks[0]->num_slots();
  }

  // Runs fn(r) on every rank's thread at once and waits for all of them. On a failure: the failing
  // rank asks its peers to abort (when `collective` work may be pending) and the call throws one
  // Error naming the first failing rank.
  void run(const std::function<void(int)>& fn, bool collective = true) {
    FT_CHECK(broken.empty(), "tensor-parallel model unusable after an earlier failure: " + broken);
    std::fill(rank_errors.begin(), rank_errors.end(), "");
    for (auto& f : device_failed) f.store(false);
    std::mutex first_mu;
    int first = -1;
    std::string first_msg;
    for (int r = 0; r < tp; ++r) {
      workers[static_cast<size_t>(r)]->post([&, r] {
        try {
          fn(r);
        } catch (...) {
          const std::string msg = what_of(std::current_exception());
          {
            std::lock_guard<std::mutex> lock(first_mu);
            if (first < 0) first = r, first_msg = msg;
          }
          if (collective && device_failed[static_cast<size_t>(r)].load()) {
            if (!p2p.empty()) p2p[0]->abort();  // the whole group's kernels
            for (int o = 0; o < tp; ++o)
              if (o != r) comms[static_cast<size_t>(o)]->request_abort("rank " + str(r) + " failed: " + msg);
          }
          throw;
        }
      });
    }
    int failed = 0;
    for (int r = 0; r < tp; ++r) {
      std::exception_ptr e = workers[static_cast<size_t>(r)]->wait();
      if (e) {
        ++failed;
        rank_errors[static_cast<size_t>(r)] = what_of(e);
      }
    }
    if (failed == 0) return;
    bool any_device = false;
    for (auto& f : device_failed) any_device = any_device || f.load();
    for (auto& c : comms) any_device = any_device || c->aborted();
    const std::string msg = "tensor-parallel step failed on rank " + str(first) + " (device " +
                            str(devices[static_cast<size_t>(first)]) + "): " + first_msg + " (" + str(failed) + " of " +
                            str(tp) + " ranks stopped with an error)";
    if (collective && any_device) broken = msg;
    FT_FAIL(msg);
  }

  // The rank-local copy of the batch's plan (or one planned here), or nullptr for other attentions.
  const Plan* rank_plan(const DecodeBatch& batch, DecodeAttention attention) {
    FT_CHECK(batch.tree != nullptr, "decode: batch has no tree");
    if (attention != DecodeAttention::kFastTree || batch.tree->num_queries() == 0 ||
        batch.tree->num_queries() != static_cast<int64_t>(batch.tokens.size()))
      return batch.plan;  // the ranks reject it with GpuModel's messages
    if (batch.plan == nullptr) {
      validate_tree(*batch.tree, num_slots);  // the planner's precondition
      planner.build(*batch.tree, local.attn_shape(), plan);
      return &plan;
    }
    const Plan& p = *batch.plan;
    const bool global = p.num_qo_heads == config.num_attention_heads && p.num_kv_heads == config.num_key_value_heads;
    const bool rank_local = p.num_qo_heads == local.num_attention_heads && p.num_kv_heads == local.num_key_value_heads;
    FT_CHECK(global || rank_local, "decode: the batch's plan was built for " + str(p.num_qo_heads) + "/" +
                                       str(p.num_kv_heads) + " qo/kv heads, the model has " +
                                       str(config.num_attention_heads) + "/" + str(config.num_key_value_heads) + " (" +
                                       str(local.num_attention_heads) + "/" + str(local.num_key_value_heads) +
                                       " per rank)");
    plan = p;  // reuses plan's buffers: no allocation in steady state
    plan.num_qo_heads = local.num_attention_heads;
    plan.num_kv_heads = local.num_key_value_heads;
    return &plan;
  }

  void count_step(Clock::time_point t0) {
    ++times.steps;
    times.total_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  }
};

TpGpuModel::TpGpuModel(const ModelWeights& weights, int32_t num_slots, TpGpuModelOptions options)
    : impl_(std::make_unique<Impl>(weights.config, std::move(options))) {
  impl_->build(
      num_slots,
      [&](int, int32_t slots, const GpuModelOptions& o) { return std::make_unique<GpuModel>(weights, slots, o); },
      static_cast<int64_t>(gpu_weight_bytes(impl_->local)));
}

TpGpuModel::TpGpuModel(const SafetensorsFolder& folder, const ModelConfig& config, int32_t num_slots,
                       TpGpuModelOptions options)
    : impl_(std::make_unique<Impl>(config, std::move(options))) {
  impl_->build(
      num_slots,
      [&](int, int32_t slots, const GpuModelOptions& o) { return std::make_unique<GpuModel>(folder, config, slots, o); },
      static_cast<int64_t>(gpu_weight_bytes(impl_->local)));
}

TpGpuModel::TpGpuModel(const ModelConfig& config, uint64_t seed, int32_t num_slots, TpGpuModelOptions options)
    : impl_(std::make_unique<Impl>(config, std::move(options))) {
  impl_->build(
      num_slots,
      [&](int, int32_t slots, const GpuModelOptions& o) { return std::make_unique<GpuModel>(config, seed, slots, o); },
      static_cast<int64_t>(gpu_weight_bytes(impl_->local)));
}

TpGpuModel::~TpGpuModel() = default;

const ModelConfig& TpGpuModel::config() const { return impl_->config; }
int32_t TpGpuModel::num_slots() const { return impl_->num_slots; }
int TpGpuModel::tp() const { return impl_->tp; }
const ModelConfig& TpGpuModel::local_config() const { return impl_->local; }
const Plan& TpGpuModel::last_plan() const { return impl_->plan; }
const std::string& TpGpuModel::all_reduce_path() const { return impl_->reduce_path; }
const std::vector<std::string>& TpGpuModel::last_rank_errors() const { return impl_->rank_errors; }
int64_t TpGpuModel::replica_mismatches() const { return impl_->replica_mismatches; }

std::vector<float> TpGpuModel::prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                                       std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                                       bool all_logits) {
  Impl& m = *impl_;
  std::vector<float> out;
  m.run([&](int r) {
    std::vector<float> logits = m.ranks[static_cast<size_t>(r)]->prefill(tokens, positions, slots, context_slots, all_logits);
    if (r == 0) out = std::move(logits);
  });
  return out;
}

std::vector<float> TpGpuModel::prefill_batch(std::span<const PrefillSeq> seqs) {
  Impl& m = *impl_;
  std::vector<float> out;
  m.run([&](int r) {
    std::vector<float> logits = m.ranks[static_cast<size_t>(r)]->prefill_batch(seqs);
    if (r == 0) out = std::move(logits);
  });
  return out;
}

std::vector<float> TpGpuModel::decode(const DecodeBatch& batch, DecodeAttention attention) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  DecodeBatch rank_batch = batch;
  rank_batch.plan = m.rank_plan(batch, attention);
  std::vector<float> out;
  m.run([&](int r) {
    std::vector<float> logits = m.ranks[static_cast<size_t>(r)]->decode(rank_batch, attention);
    if (r == 0) out = std::move(logits);
  });
  if (!out.empty()) m.count_step(t0);
  return out;
}

std::vector<int32_t> TpGpuModel::decode_greedy(const DecodeBatch& batch, DecodeAttention attention) {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  DecodeBatch rank_batch = batch;
  rank_batch.plan = m.rank_plan(batch, attention);
  m.run([&](int r) { m.greedy[static_cast<size_t>(r)] = m.ranks[static_cast<size_t>(r)]->decode_greedy(rank_batch, attention); });
  for (int r = 1; r < m.tp; ++r)
    if (m.greedy[static_cast<size_t>(r)] != m.greedy[0]) {
      ++m.replica_mismatches;
      break;
    }
  if (!m.greedy[0].empty()) m.count_step(t0);
  return m.greedy[0];
}

void TpGpuModel::set_profiling(bool on) {
  for (auto& r : impl_->ranks) r->set_profiling(on);
}

DecodeTimes TpGpuModel::decode_times() const {
  DecodeTimes t = impl_->ranks[0]->decode_times();
  t.steps = impl_->times.steps;
  t.total_ms = impl_->times.total_ms;
  return t;
}

void TpGpuModel::reset_times() {
  impl_->times = {};
  for (auto& r : impl_->ranks) r->reset_times();
}

}  // namespace fasttree
