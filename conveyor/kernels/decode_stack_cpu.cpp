// The whole decoder-layer stack of a Llama-family model with quantized weights, for a decode batch
// of a few rows, in one call and one OpenMP parallel region.
//
// At one row a step streams the model's weights once (~4 ms for the built-in model's 92 MiB); run
// op by op from Python it also pays ~100 us of dispatch and thread fork/join per layer, as much
// again. Here the threads stay up for the whole stack and meet at barriers (8 per layer): the
// matmuls split their output tiles across threads (each streams its own slice of every weight),
// attention splits the (row, head) pairs, and the small elementwise steps (norms, RoPE, K/V writes,
// SiLU, residual adds, activation quantization) run on thread 0 in between. The residual stream,
// norms, RoPE and attention are fp32; K/V are stored in the cache's dtype.
#include "attention_cpu.h"
#include "quant.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <memory>

namespace {

using conveyor::Activations;

// One row segment of a quantized linear: rows [n0, n0 + rows) of the output.
struct Segment {
    torch::Tensor data, scales;
    int64_t type, rows, n0;
    bool tiled() const { return conveyor::is_tiled_type(type); }
    int64_t units() const { return tiled() ? (rows + conveyor::kTileRows - 1) / conveyor::kTileRows : rows; }
};

struct Linear {
    std::vector<Segment> segments;
    torch::Tensor bias;  // fp32 [N] or undefined
    int64_t N = 0, K = 0;

    // This thread's share of every segment: out [M, N] (row stride ldo) from the quantized input.
    void run(const Activations& a, float* out, int64_t ldo, int thread, int threads) const {
        for (const Segment& s : segments) {
            const int64_t u = s.units(), u0 = u * thread / threads, u1 = u * (thread + 1) / threads;
            if (u0 == u1) continue;
            const uint8_t* w = s.data.data_ptr<uint8_t>();
            if (s.tiled())
                conveyor::tiles_matmul(s.type, w, s.scales.numel() ? s.scales.data_ptr<float>() : nullptr, a, u0, u1,
                                       s.rows, out + s.n0, ldo);
            else
                conveyor::rows_matmul(s.type, w, s.data.size(1), a, u0, u1, out + s.n0, ldo);
        }
    }
    void add_bias(float* out, int64_t M) const {
        if (!bias.defined()) return;
        const float* b = bias.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m)
            for (int64_t n = 0; n < N; ++n) out[m * N + n] += b[n];
    }
};

struct Layer {
    torch::Tensor input_norm, post_norm;  // fp32
    Linear qkv, o, gate_up, down;
    int64_t group = 0;  // which layer group's attention metadata this layer reads
};

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// Rotate-half RoPE in place on `heads` heads of dim D.
void rope(float* x, int64_t heads, int64_t D, const float* c, const float* s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; ++h, x += D)
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
}

template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace

class DecodeStack {
  public:
    DecodeStack(int64_t hidden, int64_t intermediate, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                double scale, int64_t max_rows)
        : hidden_(hidden), inter_(intermediate), H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps), scale_(scale),
          max_rows_(max_rows) {
        const int64_t qkv = (H_ + 2 * Hkv_) * D_;
        xn_.resize(max_rows * std::max(hidden, H_ * D_));
        qkv_.resize(max_rows * qkv);
        attn_.resize(max_rows * H_ * D_);
        mid_.resize(max_rows * 2 * intermediate);
        act_.resize(max_rows * intermediate);
        out_.resize(max_rows * hidden);
    }

    // Segments: (data uint8, qtype, row scales (empty if none), rows) in output order.
    void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, std::vector<std::vector<py::tuple>> linears,
                   std::vector<c10::optional<torch::Tensor>> biases, int64_t group) {
        TORCH_CHECK(linears.size() == 4 && biases.size() == 4, "qkv, o, gate_up and down expected");
        Layer layer;
        layer.input_norm = input_norm.to(torch::kFloat32).contiguous();
        layer.post_norm = post_norm.to(torch::kFloat32).contiguous();
        layer.group = group;
        const int64_t K[4] = {hidden_, H_ * D_, hidden_, inter_};
        const int64_t N[4] = {(H_ + 2 * Hkv_) * D_, hidden_, 2 * inter_, hidden_};
        Linear* dst[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
        for (int i = 0; i < 4; ++i) {
            Linear& lin = *dst[i];
            lin.N = N[i], lin.K = K[i];
            int64_t n0 = 0;
            for (const py::tuple& t : linears[i]) {
                Segment s{t[0].cast<torch::Tensor>(), t[2].cast<torch::Tensor>(), t[1].cast<int64_t>(),
                          t[3].cast<int64_t>(), n0};
                n0 += s.rows;
                lin.segments.push_back(s);
            }
            TORCH_CHECK(n0 == N[i], "linear ", i, " has ", n0, " output rows, expected ", N[i]);
            if (biases[i].has_value() && biases[i]->defined()) lin.bias = biases[i]->to(torch::kFloat32).contiguous();
        }
        layers_.push_back(std::move(layer));
    }

    // x [B, hidden] fp32 (updated in place and returned); cos/sin [B, D] fp32; per layer its KV cache
    // [2, slots, Hkv, D], decode block tables [B, width], context lengths [B] and the slots [B] the
    // new K/V go to; `threads` <= 0: torch's intra-op thread count.
    torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kv,
                          std::vector<torch::Tensor> tables, std::vector<torch::Tensor> lens,
                          std::vector<torch::Tensor> slots, int64_t page_size, int64_t threads) {
        const int64_t B = x.size(0);
        TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) == hidden_, "x must be fp32 [B, hidden]");
        TORCH_CHECK(B >= 1 && B <= max_rows_, "the stack takes 1 to ", max_rows_, " rows, got ", B);
        TORCH_CHECK(kv.size() == layers_.size(), "one KV cache per layer expected");
        TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32, "fp32 cos/sin");
        const auto dtype = kv[0].scalar_type();
        TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "the KV cache must be fp32 or bf16");
        for (auto& t : kv) TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dtype, "contiguous KV caches of one dtype");
        const int nt = static_cast<int>(threads > 0 ? threads : at::get_num_threads());
        if (dtype == torch::kFloat32) run<float>(x, cos, sin, kv, tables, lens, slots, page_size, nt);
        else run<at::BFloat16>(x, cos, sin, kv, tables, lens, slots, page_size, nt);
        return x;
    }

    int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  private:
    template <typename T>
    void run(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<torch::Tensor>& kv,
             const std::vector<torch::Tensor>& tables, const std::vector<torch::Tensor>& lens,
             const std::vector<torch::Tensor>& slots, int64_t page, int threads) {
        const int64_t B = x.size(0), qd = H_ * D_, kvd = Hkv_ * D_, qkv_n = qd + 2 * kvd, G = H_ / Hkv_;
        float* xp = x.data_ptr<float>();
        const float* cp = cos.data_ptr<float>();
        const float* sp = sin.data_ptr<float>();
        const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
#pragma omp parallel num_threads(std::max(1, threads))
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            std::vector<float> scores;
            std::vector<const T*> krows, vrows;
            for (const Layer& L : layers_) {
                const int64_t g = L.group;
                if (tid == 0) {
                    for (int64_t b = 0; b < B; ++b)
                        rms_norm(xp + b * hidden_, L.input_norm.data_ptr<float>(), hidden_, eps, xn_.data() + b * hidden_);
                    conveyor::quantize_rows(xn_.data(), hidden_, B, hidden_, act_q_);
                }
#pragma omp barrier
                L.qkv.run(act_q_, qkv_.data(), qkv_n, tid, nt);
#pragma omp barrier
                if (tid == 0) {
                    L.qkv.add_bias(qkv_.data(), B);
                    T* kc = kv[&L - layers_.data()].template data_ptr<T>();
                    const int64_t cache_slots = kv[&L - layers_.data()].size(1);
                    const int64_t* slot = slots[g].data_ptr<int64_t>();
                    for (int64_t b = 0; b < B; ++b) {
                        float* row = qkv_.data() + b * qkv_n;
                        rope(row, H_ + Hkv_, D_, cp + b * D_, sp + b * D_);  // q heads, then k heads
                        store_row(kc + slot[b] * kvd, row + qd, kvd);
                        store_row(kc + (cache_slots + slot[b]) * kvd, row + qd + kvd, kvd);
                    }
                }
#pragma omp barrier
                {
                    const T* kc = kv[&L - layers_.data()].template data_ptr<T>();
                    const T* vc = kc + kv[&L - layers_.data()].size(1) * kvd;
                    const int64_t* bt = tables[g].data_ptr<int64_t>();
                    const int64_t width = tables[g].size(1);
                    const int64_t* len = lens[g].data_ptr<int64_t>();
                    const int64_t pairs = B * H_, p0 = pairs * tid / nt, p1 = pairs * (tid + 1) / nt;
                    int64_t built = -1;
                    for (int64_t p = p0; p < p1; ++p) {
                        const int64_t b = p / H_, h = p % H_, n = len[b];
                        if (built != b) {
                            conveyor::context_rows(kc, vc, bt + b * width, n, page, kvd, krows, vrows);
                            built = b;
                        }
                        scores.resize(n);
                        conveyor::attend_head(qkv_.data() + b * qkv_n + h * D_, krows.data(), vrows.data(),
                                              (h / G) * D_, n, D_, scale, 0.f, scores.data(), attn_.data() + b * qd + h * D_);
                    }
                }
#pragma omp barrier
                if (tid == 0) conveyor::quantize_rows(attn_.data(), qd, B, qd, act_q_);
#pragma omp barrier
                L.o.run(act_q_, out_.data(), hidden_, tid, nt);
#pragma omp barrier
                if (tid == 0) {
                    L.o.add_bias(out_.data(), B);
                    for (int64_t i = 0; i < B * hidden_; ++i) xp[i] += out_[i];
                    for (int64_t b = 0; b < B; ++b)
                        rms_norm(xp + b * hidden_, L.post_norm.data_ptr<float>(), hidden_, eps, xn_.data() + b * hidden_);
                    conveyor::quantize_rows(xn_.data(), hidden_, B, hidden_, act_q_);
                }
#pragma omp barrier
                L.gate_up.run(act_q_, mid_.data(), 2 * inter_, tid, nt);
#pragma omp barrier
                if (tid == 0) {
                    L.gate_up.add_bias(mid_.data(), B);
                    for (int64_t b = 0; b < B; ++b) {
                        const float* gate = mid_.data() + b * 2 * inter_;
                        const float* up = gate + inter_;
                        float* a = act_.data() + b * inter_;
                        for (int64_t i = 0; i < inter_; ++i) a[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
                    }
                    conveyor::quantize_rows(act_.data(), inter_, B, inter_, act_q_);
                }
#pragma omp barrier
                L.down.run(act_q_, out_.data(), hidden_, tid, nt);
#pragma omp barrier
                if (tid == 0) {
                    L.down.add_bias(out_.data(), B);
                    for (int64_t i = 0; i < B * hidden_; ++i) xp[i] += out_[i];
                }
#pragma omp barrier
            }
        }
    }

    int64_t hidden_, inter_, H_, Hkv_, D_;
    double eps_, scale_;
    int64_t max_rows_;
    std::vector<Layer> layers_;
    std::vector<float> xn_, qkv_, attn_, mid_, act_, out_;
    Activations act_q_;
};

void register_decode_stack(py::module_& m) {
    py::class_<DecodeStack>(m, "DecodeStack")
        .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t>())
        .def("add_layer", &DecodeStack::add_layer)
        .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
