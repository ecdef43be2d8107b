// A mixture-of-experts block in one native call per layer and step (moe_block.h): the eager layer's entry points
// (kernels/layer_ops.py's `MoeBlock`), and `MoeBlock::run`, which the decode stack calls inside its own region.
//
// Run op by op from Python, a block costs a router matmul, a softmax and top-k, a sort, and per busy expert
// ~10 small ops whose dispatch outweighs a decode step's few rows per expert. Here the threads meet at
// barriers between the phases: (1) the router's and the shared expert's inputs prepared, by rows; (2) the
// router's and the shared gate/up products, split by tiles; (3) each row's routing, the shared expert's
// activation; (4) on one thread, the rows sorted by expert and the products split into (expert, tile range)
// items, about four per thread over all experts, so every thread streams weights even with few experts;
// (5) every busy expert's input rows gathered and prepared; (6) all gate/up products and the shared down;
// (7) the activations; (8) all down products; (9) each token's sum, the threads splitting the hidden columns,
// so the additions to one value come in the sorted order whatever the thread count.
//
// gpt-oss's experts (`limit` > 0): biases on both products (the gate/up one added before the activation in (7),
// the down one to each row before its weighting in (9)) and the clamped SwiGLU instead of SiLU * up.
#include "moe_block.h"

#include "row_ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <utility>

namespace conveyor {

namespace {

// The k best of `scores` (ties: the lower expert first), in descending order.
void top_k(const float* scores, int64_t n, int64_t k, int64_t* ids) {
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j && !taken; ++i) taken = ids[i] == e;
            if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
        }
        ids[j] = best;
    }
}

// p = softmax(x) over n values, in fp32.
void softmax(const float* x, int64_t n, float* p) {
    float m = x[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (p[i] = std::exp(x[i] - m));
    for (int64_t i = 0; i < n; ++i) p[i] /= sum;
}

}  // namespace

MoeBlock::MoeBlock(int64_t hidden, int64_t intermediate, double alpha, double limit)
    : hidden_(hidden), inter_(intermediate), alpha_(static_cast<float>(alpha)), limit_(static_cast<float>(limit)) {}

void MoeBlock::add_expert(const SegmentSpec* gate_up, int64_t n_gate_up, const SegmentSpec* down, int64_t n_down,
                          const float* gate_up_bias, const float* down_bias) {
    Expert e;
    e.gate_up.K = hidden_, e.down.K = inter_;
    e.gate_up.add_segments(gate_up, n_gate_up);
    e.down.add_segments(down, n_down);
    CONVEYOR_CHECK(e.gate_up.N == 2 * inter_ && e.down.N == hidden_, "expert ", experts_.size(), ": gate/up has ",
                   e.gate_up.N, " rows (expected ", 2 * inter_, "), down ", e.down.N, " (expected ", hidden_, ")");
    e.gate_up.set_bias(gate_up_bias);
    e.down.set_bias(down_bias);
    experts_.push_back(std::move(e));
    in_.emplace_back();
    mid_in_.emplace_back();
}

void MoeBlock::set_router(const SegmentSpec* parts, int64_t n_parts, const float* bias, const MoeRouting& routing,
                          bool shared_gate) {
    const int64_t E = num_experts();
    router_ = Linear{};
    router_.K = hidden_;
    router_.add_segments(parts, n_parts);
    CONVEYOR_CHECK(router_.N == E + (shared_gate ? 1 : 0), "the router has ", router_.N, " rows, expected ",
                   E + (shared_gate ? 1 : 0), shared_gate ? " (the experts', then the shared gate's)" : "");
    CONVEYOR_CHECK(!router_.quantized, "the router must be in F32 tiles");
    CONVEYOR_CHECK(routing.top_k >= 1 && routing.top_k <= E, "top_k ", routing.top_k, " must be between 1 and ", E);
    CONVEYOR_CHECK(routing.kind >= kRouteSoftmax && routing.kind <= kRouteSigmoid, "unknown routing ", routing.kind);
    CONVEYOR_CHECK(routing.bias.empty() || static_cast<int64_t>(routing.bias.size()) == E, "one bias per expert");
    router_.set_bias(bias);
    routing_ = routing;
    shared_gate_ = shared_gate;
}

void MoeBlock::set_shared(const SegmentSpec* gate_up, int64_t n_gate_up, const SegmentSpec* down, int64_t n_down,
                          int64_t intermediate) {
    shared_up_ = Linear{}, shared_down_ = Linear{};
    shared_up_.K = hidden_, shared_down_.K = intermediate;
    shared_up_.add_segments(gate_up, n_gate_up);
    shared_down_.add_segments(down, n_down);
    CONVEYOR_CHECK(shared_up_.N == 2 * intermediate && shared_down_.N == hidden_, "the shared expert's gate/up has ",
                   shared_up_.N, " rows (expected ", 2 * intermediate, "), down ", shared_down_.N, " (expected ",
                   hidden_, ")");
    shared_inter_ = intermediate;
}

void MoeBlock::begin(int64_t rows, bool routed) {
    CONVEYOR_CHECK(router_.N > 0, "the block has no router");
    CONVEYOR_CHECK(rows >= 0, "a negative row count");
    rows_ = rows, routed_ = routed;
    const int64_t k = routing_.top_k;
    weights_.resize(rows * k), ids_.resize(rows * k);
    if (!routed) {
        router_.shape(router_in_, rows);
        logits_.resize(rows * router_.N);
        gates_.resize(rows);
        if (shared()) {
            shared_up_.shape(shared_in_, rows);
            shared_down_.shape(shared_down_in_, rows);
            shared_mid_.resize(rows * 2 * shared_inter_), shared_act_.resize(rows * shared_inter_);
            shared_out_.resize(rows * hidden_);
        }
    }
}

void MoeBlock::set_routes(const float* weights, const int64_t* ids) {
    CONVEYOR_CHECK(routed_, "set_routes needs begin(rows, true)");
    const int64_t n = rows_ * routing_.top_k, E = num_experts();
    for (int64_t i = 0; i < n; ++i) CONVEYOR_CHECK(ids[i] >= 0 && ids[i] < E, "expert id ", ids[i], " out of range");
    std::copy(weights, weights + n, weights_.begin());
    std::copy(ids, ids + n, ids_.begin());
}

void MoeBlock::select(const float* logits, float* w, int64_t* ids, std::vector<float>& s) const {
    const int64_t E = num_experts(), k = routing_.top_k;
    const bool biased = !routing_.bias.empty();
    s.resize(2 * E);
    float* p = s.data();
    float* choose = s.data() + E;
    switch (routing_.kind) {
        case kRouteTopkSoftmax: {
            top_k(logits, E, k, ids);
            for (int64_t j = 0; j < k; ++j) p[j] = logits[ids[j]];
            softmax(p, k, w);
            return;
        }
        case kRouteSigmoid:
            for (int64_t e = 0; e < E; ++e) p[e] = 1.f / (1.f + std::exp(-logits[e]));
            break;
        default:
            softmax(logits, E, p);
    }
    for (int64_t e = 0; e < E; ++e) choose[e] = biased ? p[e] + routing_.bias[e] : p[e];
    top_k(choose, E, k, ids);
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += (w[j] = p[ids[j]]);
    if (routing_.kind == kRouteBiased) {
        sum = std::max(sum, routing_.norm_min);
    } else if (routing_.kind == kRouteSigmoid) {
        sum = routing_.renormalize ? sum + 1e-6f : 1.f;
    } else if (!routing_.renormalize) {
        sum = 1.f;
    }
    for (int64_t j = 0; j < k; ++j) {
        if (sum != 1.f) w[j] /= sum;
        if (routing_.kind == kRouteSigmoid) w[j] *= routing_.scale;
    }
}

void MoeBlock::group(int nt) {
    const int64_t E = num_experts(), R = rows_ * routing_.top_k, H = hidden_, I = inter_;
    counts_.assign(E, 0);
    for (int64_t i = 0; i < R; ++i) ++counts_[ids_[i]];
    start_.assign(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) start_[e + 1] = start_[e] + counts_[e];
    std::vector<int64_t> next(start_.begin(), start_.end() - 1);
    tokens_.resize(R), row_expert_.resize(R), row_weights_.resize(R);
    for (int64_t i = 0; i < R; ++i) {  // a stable sort by expert: tokens in batch order within one
        const int64_t e = ids_[i], r = next[e]++;
        tokens_[r] = i / routing_.top_k, row_expert_[r] = e, row_weights_[r] = weights_[i];
    }
    const auto items = [&](bool down, std::vector<WorkItem>& w) {
        int64_t total = 0;
        for (int64_t e = 0; e < E; ++e)
            if (counts_[e]) total += (down ? experts_[e].down : experts_[e].gate_up).tiles();
        const int64_t chunk = std::max<int64_t>(1, total / (4 * nt));
        w.clear();
        for (int64_t e = 0; e < E; ++e) {
            if (!counts_[e]) continue;
            const int64_t u = (down ? experts_[e].down : experts_[e].gate_up).tiles();
            for (int64_t u0 = 0; u0 < u; u0 += chunk) w.push_back({e, u0, std::min(u, u0 + chunk)});
        }
    };
    items(false, up_items_);
    items(true, down_items_);
    for (int64_t e = 0; e < E; ++e) {
        if (!counts_[e]) continue;
        experts_[e].gate_up.shape(in_[e], counts_[e]);
        experts_[e].down.shape(mid_in_[e], counts_[e]);
    }
    mid_.resize(R * 2 * I), act_.resize(R * I), y_.resize(R * H);
}

template <typename T>
void MoeBlock::run(const float* x, int64_t ldx, float* out, int64_t ldo, int tid, int nt) {
    const int64_t rows = rows_, r0 = rows * tid / nt, r1 = rows * (tid + 1) / nt, I = inter_, k = routing_.top_k;
    if (!routed_) {
        router_.prepare(x, ldx, r0, r1, router_in_);
        if (shared()) shared_up_.prepare(x, ldx, r0, r1, shared_in_);
#pragma omp barrier
        router_.run(router_in_, logits_.data(), router_.N, tid, nt);
        if (shared()) shared_up_.run(shared_in_, shared_mid_.data(), 2 * shared_inter_, tid, nt);
#pragma omp barrier
        std::vector<float> scores;
        for (int64_t t = r0; t < r1; ++t) {
            float* logits = logits_.data() + t * router_.N;
            router_.add_bias_row(logits);
            select(logits, weights_.data() + t * k, ids_.data() + t * k, scores);
            if (shared_gate_) gates_[t] = 1.f / (1.f + std::exp(-logits[num_experts()]));
            if (shared()) {
                float* m = shared_mid_.data() + t * 2 * shared_inter_;
                round_row<T>(m, 2 * shared_inter_);
                silu_mul_row<T>(m, m + shared_inter_, shared_inter_, shared_act_.data() + t * shared_inter_);
            }
        }
        if (shared()) shared_down_.prepare(shared_act_.data(), shared_inter_, r0, r1, shared_down_in_);
#pragma omp barrier
    }
    if (tid == 0) group(nt);
#pragma omp barrier
    const int64_t R = rows * k;
    const int64_t g0 = R * tid / nt, g1 = R * (tid + 1) / nt;
    for (int64_t r = g0; r < g1; ++r) {  // the busy experts' input rows, gathered and prepared
        const int64_t e = row_expert_[r];
        experts_[e].gate_up.prepare(x + tokens_[r] * ldx, 0, r - start_[e], r - start_[e] + 1, in_[e]);
    }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1) nowait
    for (size_t i = 0; i < up_items_.size(); ++i) {
        const WorkItem& w = up_items_[i];
        experts_[w.expert].gate_up.run_tiles(in_[w.expert], mid_.data() + start_[w.expert] * 2 * I, 2 * I, w.u0, w.u1);
    }
    if (!routed_ && shared()) shared_down_.run(shared_down_in_, shared_out_.data(), hidden_, tid, nt);
#pragma omp barrier
    for (int64_t r = g0; r < g1; ++r) {  // the activation, and the down input
        const int64_t e = row_expert_[r];
        float* m = mid_.data() + r * 2 * I;
        experts_[e].gate_up.add_bias_row(m);
        if (limit_ > 0.f) clamped_swiglu(m, m + I, I, alpha_, limit_, act_.data() + r * I);
        else silu_mul(m, m + I, I, act_.data() + r * I);
        experts_[e].down.prepare(act_.data() + start_[e] * I, I, r - start_[e], r - start_[e] + 1, mid_in_[e]);
    }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < down_items_.size(); ++i) {
        const WorkItem& w = down_items_[i];
        experts_[w.expert].down.run_tiles(mid_in_[w.expert], y_.data() + start_[w.expert] * hidden_, hidden_, w.u0,
                                          w.u1);
    }
    combine<T>(out, ldo, tid, nt);
#pragma omp barrier
}

template <typename T>
void MoeBlock::combine(float* out, int64_t ldo, int tid, int nt) {
    const int64_t H = hidden_, c0 = H * tid / nt, c1 = H * (tid + 1) / nt, R = rows_ * routing_.top_k;
    for (int64_t t = 0; t < rows_; ++t) std::fill(out + t * ldo + c0, out + t * ldo + c1, 0.f);
    for (int64_t r = 0; r < R; ++r) {  // in the sorted order
        float* dst = out + tokens_[r] * ldo;
        const float* src = y_.data() + r * H;
        const float w = row_weights_[r];
        const std::vector<float>& bias = experts_[row_expert_[r]].down.bias;
        if (!bias.empty()) {
            const float* b = bias.data();
            for (int64_t c = c0; c < c1; ++c) dst[c] += (src[c] + b[c]) * w;
        } else {
            for (int64_t c = c0; c < c1; ++c) dst[c] += src[c] * w;
        }
    }
    for (int64_t t = 0; t < rows_; ++t) {
        float* dst = out + t * ldo;
        if (!routed_ && shared()) {
            const float* s = shared_out_.data() + t * H;
            const float g = shared_gate_ ? gates_[t] : 1.f;
            for (int64_t c = c0; c < c1; ++c) {
                const float v = round_as<T>(s[c]);  // (the shared expert's output, as its T tensor holds it)
                dst[c] += shared_gate_ ? unfused(g * v) : v;
            }
        }
        if (!routed_) round_row<T>(dst + c0, c1 - c0);  // (given routes: the caller adds the shared expert)
    }
}

void MoeBlock::forward(int dtype, const void* x, int64_t rows, float* out, int threads, const float* weights,
                       const int64_t* ids) {
    CONVEYOR_CHECK(dtype == kF32 || dtype == kBF16, "x must be fp32 or bf16");
    CONVEYOR_CHECK(!weights == !ids, "weights and ids come together");
    begin(rows, ids != nullptr);
    if (ids) set_routes(weights, ids);
    const float* xf = static_cast<const float*>(x);
    if (dtype == kBF16) xf_.resize(rows * hidden_), xf = xf_.data();
    const int nt = std::max(1, threads);
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num(), n = omp_get_num_threads();
        if (dtype == kBF16) {  // the rows this thread prepares first, as fp32
            const bf16* b = static_cast<const bf16*>(x);
            for (int64_t i = rows * tid / n * hidden_; i < rows * (tid + 1) / n * hidden_; ++i) xf_[i] = b[i];
            run<bf16>(xf, hidden_, out, hidden_, tid, n);
        } else {
            run<float>(xf, hidden_, out, hidden_, tid, n);
        }
    }
}

template void MoeBlock::run<float>(const float*, int64_t, float*, int64_t, int, int);
template void MoeBlock::run<bf16>(const float*, int64_t, float*, int64_t, int, int);

}  // namespace conveyor

using conveyor::MoeBlock;

// The C entry points (kernels/layer_ops.py's `MoeBlock`): built once per layer, freed with it.
CONVEYOR_API void* conveyor_moe_block_new(int64_t hidden, int64_t intermediate, double alpha, double limit) {
    return new MoeBlock(hidden, intermediate, alpha, limit);
}

CONVEYOR_API void conveyor_moe_block_free(void* block) { delete static_cast<MoeBlock*>(block); }

CONVEYOR_API int conveyor_moe_block_add_expert(void* block, const conveyor::SegmentSpec* gate_up, int64_t n_gate_up,
                                               const conveyor::SegmentSpec* down, int64_t n_down,
                                               const float* gate_up_bias, const float* down_bias) {
    return conveyor::guarded(1, [&] {
        static_cast<MoeBlock*>(block)->add_expert(gate_up, n_gate_up, down, n_down, gate_up_bias, down_bias);
    });
}

CONVEYOR_API int conveyor_moe_block_set_router(void* block, const conveyor::SegmentSpec* parts, int64_t n_parts,
                                               const float* bias, int kind, int64_t top_k, int renormalize,
                                               float norm_min, float scale, const float* selection_bias,
                                               int shared_gate) {
    return conveyor::guarded(1, [&] {
        conveyor::MoeRouting routing{kind, top_k, renormalize != 0, norm_min, scale, {}};
        MoeBlock* b = static_cast<MoeBlock*>(block);
        if (selection_bias) routing.bias.assign(selection_bias, selection_bias + b->num_experts());
        b->set_router(parts, n_parts, bias, routing, shared_gate != 0);
    });
}

CONVEYOR_API int conveyor_moe_block_set_shared(void* block, const conveyor::SegmentSpec* gate_up, int64_t n_gate_up,
                                               const conveyor::SegmentSpec* down, int64_t n_down,
                                               int64_t intermediate) {
    return conveyor::guarded(1, [&] {
        static_cast<MoeBlock*>(block)->set_shared(gate_up, n_gate_up, down, n_down, intermediate);
    });
}

CONVEYOR_API int conveyor_moe_block_forward(void* block, int dtype, const void* x, int64_t rows, float* out,
                                            int threads, const float* weights, const int64_t* ids) {
    return conveyor::guarded(threads, [&] {
        static_cast<MoeBlock*>(block)->forward(dtype, x, rows, out, threads, weights, ids);
    });
}

CONVEYOR_API int conveyor_moe_block_counts(void* block, int64_t* counts) {
    return conveyor::guarded(1, [&] {
        const std::vector<int64_t>& c = static_cast<MoeBlock*>(block)->counts();
        std::copy(c.begin(), c.end(), counts);
    });
}
