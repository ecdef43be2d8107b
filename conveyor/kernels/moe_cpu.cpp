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

#include <ATen/Parallel.h>
#include <omp.h>

#include <utility>

#include <vector>

namespace {

using conveyor::Activations;
using conveyor::Linear;

struct Expert {
    Linear gate_up, down;  // their `bias`: fp32 or undefined
};

struct WorkItem {
    int64_t expert, u0, u1;
};

class GroupedExperts {
  public:
    // `limit` > 0: gpt-oss's clamped SwiGLU with `alpha` (tiled_linear.h); else SiLU * up.
    GroupedExperts(int64_t hidden, int64_t intermediate, double alpha, double limit)
        : hidden_(hidden), inter_(intermediate), alpha_(static_cast<float>(alpha)), limit_(static_cast<float>(limit)) {}

    // One expert's gate/up (gate rows first) and down, as (data, type, row scales, rows) segments, and
    // their biases (fp32, or None).
    void add_expert(std::vector<py::tuple> gate_up, std::vector<py::tuple> down, c10::optional<torch::Tensor> gate_up_bias,
                    c10::optional<torch::Tensor> down_bias) {
        Expert e;
        e.gate_up.K = hidden_, e.down.K = inter_;
        e.gate_up.add_segments(gate_up);
        e.down.add_segments(down);
        TORCH_CHECK(e.gate_up.N == 2 * inter_ && e.down.N == hidden_, "expert ", experts_.size(), ": gate/up has ",
                    e.gate_up.N, " rows (expected ", 2 * inter_, "), down ", e.down.N, " (expected ", hidden_, ")");
        for (auto [bias, linear] : {std::pair{&gate_up_bias, &e.gate_up}, std::pair{&down_bias, &e.down}}) {
            if (!bias->has_value()) continue;
            TORCH_CHECK((*bias)->scalar_type() == torch::kFloat32 && (*bias)->is_contiguous() &&
                        (*bias)->numel() == linear->N, "expert ", experts_.size(), ": a bias must be contiguous fp32 [",
                        linear->N, "]");
            linear->bias = **bias;
        }
        experts_.push_back(std::move(e));
        in_.emplace_back();
        mid_act_.emplace_back();
    }

    // out [T, hidden] fp32 += for each sorted row r (token tokens[r], `counts[e]` rows per expert in
    // expert order): weights[r] * down_e(silu(gate_e(x)) * up_e(x)) with x = x[tokens[r]] (fp32 or bf16).
    void forward(torch::Tensor x, std::vector<int64_t> counts, torch::Tensor weights, torch::Tensor tokens,
                 torch::Tensor out, int64_t threads) {
        const int64_t E = static_cast<int64_t>(experts_.size()), H = hidden_, I = inter_;
        TORCH_CHECK(static_cast<int64_t>(counts.size()) == E, "one count per expert expected");
        TORCH_CHECK(x.dim() == 2 && x.size(1) == H && x.is_contiguous() &&
                    (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
                    "x must be contiguous fp32 or bf16 [tokens, hidden]");
        TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.size(0) == x.size(0) &&
                    out.size(1) == H, "out must be contiguous fp32 [tokens, hidden]");
        const int64_t R = tokens.numel();
        TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous() && weights.numel() == R &&
                    weights.scalar_type() == torch::kFloat32 && weights.is_contiguous(),
                    "tokens (int64) and weights (fp32) must be contiguous, one per row");
        std::vector<int64_t> start(E + 1, 0), row_expert(R);
        for (int64_t e = 0; e < E; ++e) {
            TORCH_CHECK(counts[e] >= 0, "negative count");
            start[e + 1] = start[e] + counts[e];
            for (int64_t r = start[e]; r < start[e + 1] && r < R; ++r) row_expert[r] = e;
        }
        TORCH_CHECK(start[E] == R, "the counts add up to ", start[E], " rows, tokens has ", R);
        const int64_t* tok = tokens.data_ptr<int64_t>();
        for (int64_t r = 0; r < R; ++r) TORCH_CHECK(tok[r] >= 0 && tok[r] < x.size(0), "token ", tok[r], " out of range");
        // Work items: each busy expert's tiles in chunks, about four per thread over all experts.
        const int nt = static_cast<int>(std::max<int64_t>(1, threads > 0 ? threads : at::get_num_threads()));
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
        const bool bf16 = x.scalar_type() == torch::kBFloat16;
        const void* xp = x.data_ptr();
        const float* wp = weights.data_ptr<float>();
        float* op = out.data_ptr<float>();
#pragma omp parallel num_threads(nt)
        {
            std::vector<float> row(bf16 ? H : 0);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; ++r) {  // (1) the input rows, gathered and prepared
                const int64_t e = row_expert[r];
                const float* src;
                if (bf16) {
                    const c10::BFloat16* b = static_cast<const c10::BFloat16*>(xp) + tok[r] * H;
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
                const torch::Tensor& bias = experts_[row_expert[r]].down.bias;
                if (bias.defined()) {
                    const float* b = bias.data_ptr<float>();
                    for (int64_t c = c0; c < c1; ++c) dst[c] += (src[c] + b[c]) * w;
                } else {
                    for (int64_t c = c0; c < c1; ++c) dst[c] += src[c] * w;
                }
            }
        }
    }

    int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }

  private:
    int64_t hidden_, inter_;
    float alpha_, limit_;
    std::vector<Expert> experts_;
    std::vector<Activations> in_, mid_act_;
    std::vector<float> mid_, act_, y_;
};

}  // namespace

void register_grouped_experts(py::module_& m) {
    py::class_<GroupedExperts>(m, "GroupedExperts")
        .def(py::init<int64_t, int64_t, double, double>(), py::arg("hidden"), py::arg("intermediate"),
             py::arg("alpha") = 1.0, py::arg("limit") = 0.0)
        .def("add_expert", &GroupedExperts::add_expert, py::arg("gate_up"), py::arg("down"),
             py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none())
        .def("forward", &GroupedExperts::forward, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("num_experts", &GroupedExperts::num_experts);
}
