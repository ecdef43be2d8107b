// A mixture-of-experts layer's experts, all of them in one call (`GroupedExperts`): weights in the
// kernels' tiles (quantized or BF16), rows grouped by expert (the caller sorted them once).
//
// Run op by op from Python, each expert with rows costs ~10 small ops (slices, two matmuls, SiLU,
// the weighting) whose dispatch outweighs a decode step's few rows per expert. Here one OpenMP region
// runs four phases with a barrier between them, whatever the number of experts: (1) every busy
// expert's input rows gathered from the batch (by token) and prepared for the kernels; (2) all their
// gate/up products, the work split into (expert, tile range) items so every thread streams weights
// even with few experts; (3) SiLU * up and the down input prepared, by rows; (4) all the down
// products, split the same way. Then (5) each row's output times its routing weight is added to its
// token's fp32 output in the sorted order (threads split the hidden columns, so the order of the
// additions to one value is the sorted order whatever the thread count).
//
// gpt-oss's experts (`limit` > 0): biases on both products (the gate/up one added before the
// activation in (3), the down one to each row before its weighting in (5)) and the clamped SwiGLU
// instead of SiLU * up; the others pay nothing for it.
#include "quant.h"
#include "tiled_linear.h"

#include <omp.h>

#include <utility>
#include <vector>

namespace {

using conveyor::Activations;
using conveyor::Linear;

struct Expert {
    Linear gate_up, down;  // their `bias`: fp32 or empty
};

struct WorkItem {
    int64_t expert, u0, u1;
};

class GroupedExperts {
  public:
    // `limit` > 0: gpt-oss's clamped SwiGLU with `alpha` (tiled_linear.h); else SiLU * up.
    GroupedExperts(int64_t hidden, int64_t intermediate, double alpha, double limit)
        : hidden_(hidden), inter_(intermediate), alpha_(static_cast<float>(alpha)), limit_(static_cast<float>(limit)) {}

    // One expert's gate/up (gate rows first) and down, as row segments, and their biases (fp32, copied,
    // or nullptr).
    void add_expert(const conveyor::SegmentSpec* gate_up, int64_t n_gate_up, const conveyor::SegmentSpec* down,
                    int64_t n_down, const float* gate_up_bias, const float* down_bias) {
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
        mid_act_.emplace_back();
    }

    // out [T, hidden] fp32 += for each sorted row r of R (token tokens[r], `counts[e]` rows per expert in
    // expert order, E counts): weights[r] * down_e(silu(gate_e(x)) * up_e(x)) with x = x[tokens[r]] (x
    // [T, hidden], fp32 or bf16 by `dtype`; all contiguous).
    void forward(int dtype, const void* x, int64_t T, const int64_t* counts, int64_t num_counts, const float* weights,
                 const int64_t* tok, int64_t R, float* op, int threads) {
        const int64_t E = static_cast<int64_t>(experts_.size()), H = hidden_, I = inter_;
        CONVEYOR_CHECK(num_counts == E, "one count per expert expected");
        std::vector<int64_t> start(E + 1, 0), row_expert(R);
        for (int64_t e = 0; e < E; ++e) {
            CONVEYOR_CHECK(counts[e] >= 0, "negative count");
            start[e + 1] = start[e] + counts[e];
            for (int64_t r = start[e]; r < start[e + 1] && r < R; ++r) row_expert[r] = e;
        }
        CONVEYOR_CHECK(start[E] == R, "the counts add up to ", start[E], " rows, tokens has ", R);
        for (int64_t r = 0; r < R; ++r) CONVEYOR_CHECK(tok[r] >= 0 && tok[r] < T, "token ", tok[r], " out of range");
        // Work items: each busy expert's tiles in chunks, about four per thread over all experts.
        const int nt = std::max(1, threads);
        const auto items = [&](bool down) {
            int64_t total = 0;
            for (int64_t e = 0; e < E; ++e)
                if (counts[e]) total += (down ? experts_[e].down : experts_[e].gate_up).tiles();
            const int64_t chunk = std::max<int64_t>(1, total / (4 * nt));
            std::vector<WorkItem> w;
            for (int64_t e = 0; e < E; ++e) {
                if (!counts[e]) continue;
                const int64_t u = (down ? experts_[e].down : experts_[e].gate_up).tiles();
                for (int64_t u0 = 0; u0 < u; u0 += chunk) w.push_back({e, u0, std::min(u, u0 + chunk)});
            }
            return w;
        };
        const std::vector<WorkItem> up_items = items(false), down_items = items(true);
        for (int64_t e = 0; e < E; ++e) {
            if (!counts[e]) continue;
            experts_[e].gate_up.shape(in_[e], counts[e]);
            experts_[e].down.shape(mid_act_[e], counts[e]);
        }
        mid_.resize(R * 2 * I);
        act_.resize(R * I);
        y_.resize(R * H);
        const bool bf16 = dtype == conveyor::kBF16;
        const void* xp = x;
        const float* wp = weights;
#pragma omp parallel num_threads(nt)
        {
            std::vector<float> row(bf16 ? H : 0);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; ++r) {  // (1) the input rows, gathered and prepared
                const int64_t e = row_expert[r];
                const float* src;
                if (bf16) {
                    const conveyor::bf16* b = static_cast<const conveyor::bf16*>(xp) + tok[r] * H;
                    for (int64_t k = 0; k < H; ++k) row[k] = static_cast<float>(b[k]);
                    src = row.data();
                } else {
                    src = static_cast<const float*>(xp) + tok[r] * H;
                }
                experts_[e].gate_up.prepare(src, 0, r - start[e], r - start[e] + 1, in_[e]);  // (row stride 0: src)
            }
#pragma omp for schedule(dynamic, 1)
            for (size_t i = 0; i < up_items.size(); ++i) {  // (2) gate/up
                const WorkItem& w = up_items[i];
                experts_[w.expert].gate_up.run_tiles(in_[w.expert], mid_.data() + start[w.expert] * 2 * I, 2 * I, w.u0,
                                                     w.u1);
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; ++r) {  // (3) the activation, and the down input
                const int64_t e = row_expert[r];
                float* m = mid_.data() + r * 2 * I;
                experts_[e].gate_up.add_bias_row(m);
                if (limit_ > 0.f) conveyor::clamped_swiglu(m, m + I, I, alpha_, limit_, act_.data() + r * I);
                else conveyor::silu_mul(m, m + I, I, act_.data() + r * I);
                experts_[e].down.prepare(act_.data() + start[e] * I, I, r - start[e], r - start[e] + 1, mid_act_[e]);
            }
#pragma omp for schedule(dynamic, 1)
            for (size_t i = 0; i < down_items.size(); ++i) {  // (4) down
                const WorkItem& w = down_items[i];
                experts_[w.expert].down.run_tiles(mid_act_[w.expert], y_.data() + start[w.expert] * H, H, w.u0, w.u1);
            }
            const int tid = omp_get_thread_num(), n = omp_get_num_threads();
            const int64_t c0 = H * tid / n, c1 = H * (tid + 1) / n;
            for (int64_t r = 0; r < R; ++r) {  // (5) the weighted sum, in the sorted order
                float* dst = op + tok[r] * H;
                const float* src = y_.data() + r * H;
                const float w = wp[r];
                const std::vector<float>& bias = experts_[row_expert[r]].down.bias;
                if (!bias.empty()) {
                    const float* b = bias.data();
                    for (int64_t c = c0; c < c1; ++c) dst[c] += (src[c] + b[c]) * w;
                } else {
                    for (int64_t c = c0; c < c1; ++c) dst[c] += src[c] * w;
                }
            }
        }
    }

  private:
    int64_t hidden_, inter_;
    float alpha_, limit_;
    std::vector<Expert> experts_;
    std::vector<Activations> in_, mid_act_;
    std::vector<float> mid_, act_, y_;
};

}  // namespace

// The C entry points (kernels/matmul_ops.py's `GroupedExperts`): built once per layer, freed with it.
CONVEYOR_API void* conveyor_grouped_experts_new(int64_t hidden, int64_t intermediate, double alpha, double limit) {
    return new GroupedExperts(hidden, intermediate, alpha, limit);
}

CONVEYOR_API void conveyor_grouped_experts_free(void* experts) { delete static_cast<GroupedExperts*>(experts); }

CONVEYOR_API int conveyor_grouped_experts_add_expert(void* experts, const conveyor::SegmentSpec* gate_up,
                                                     int64_t n_gate_up, const conveyor::SegmentSpec* down, int64_t n_down,
                                                     const float* gate_up_bias, const float* down_bias) {
    return conveyor::guarded(1, [&] {
        static_cast<GroupedExperts*>(experts)->add_expert(gate_up, n_gate_up, down, n_down, gate_up_bias, down_bias);
    });
}

CONVEYOR_API int conveyor_grouped_experts_forward(void* experts, int dtype, const void* x, int64_t T,
                                                  const int64_t* counts, int64_t num_counts, const float* weights,
                                                  const int64_t* tokens, int64_t R, float* out, int threads) {
    return conveyor::guarded(threads, [&] {
        static_cast<GroupedExperts*>(experts)->forward(dtype, x, T, counts, num_counts, weights, tokens, R, out, threads);
    });
}
