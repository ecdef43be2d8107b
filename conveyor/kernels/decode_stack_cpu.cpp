// The whole decoder-layer stack of a Llama-family model with tiled weights (quantized or bf16), for a
// decode batch of up to 64 rows, in one call and one OpenMP parallel region.
//
// At one row a step streams the model's weights once (~4 ms for the built-in model's 92 MiB); run
// op by op from Python it also pays ~100 us of dispatch and thread fork/join per layer, as much
// again. Here the threads stay up for the whole stack and meet at barriers (8 a layer; 10 when
// there are fewer rows than threads): the matmuls split their output tiles across threads (each
// streams its own slice of every weight), and the elementwise steps (norms, RoPE, K/V writes, SiLU,
// residual adds, activation quantization) and attention split the rows, or, with fewer rows than
// threads, attention splits the (row, kv head) pairs.
//
// It computes exactly what the eager layers compute, bit for bit: the same GEMM and attention kernels,
// the fused ops' per-row arithmetic (row_ops.h), and in a bf16 model every value rounded to bf16 where
// the eager path's bf16 tensors round it (projection outputs, attention output, residual adds); values
// are held in fp32 arrays, bf16-exact. So a request's tokens do not depend on whether its step went
// through the stack (decode-only, <= 64 rows) or the eager layers (batch invariance).
#include "attention_cpu.h"
#include "quant.h"
#include "row_ops.h"
#include "tiled_linear.h"
#include "vec_math.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <memory>

namespace {

using conveyor::Activations;
using conveyor::Linear;
using conveyor::Segment;
using conveyor::silu_mul;

struct Layer {
    torch::Tensor input_norm, post_norm;  // fp32
    Linear qkv, o, gate_up, down;
    int64_t group = 0;  // which layer group's attention metadata this layer reads
};

// x[0:n] rounded to T where T is bf16 (what a bf16 tensor holds); fp32 keeps it.
template <typename T>
void round_row(float* x, int64_t n) {
    if constexpr (std::is_same_v<T, float>) return;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, conveyor::round_bf16(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; ++i) x[i] = conveyor::round_as<T>(x[i]);
}

// The residual add of a layer's output: x = x + y, rounded as a bf16 add rounds.
template <typename T>
void add_row(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = conveyor::round_as<T>(x[i] + y[i]);
}

template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) conveyor::store16(dst + i, _mm512_loadu_ps(src + i));
#endif
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace

class DecodeStack {
  public:
    DecodeStack(int64_t hidden, int64_t intermediate, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                double scale, int64_t max_rows)
        : hidden_(hidden), inter_(intermediate), H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps), scale_(scale),
          max_rows_(max_rows) {
        TORCH_CHECK(head_dim <= conveyor::kMaxDecodeHeadDim, "head dim ", head_dim, " is above the CPU kernel's limit of ",
                    conveyor::kMaxDecodeHeadDim);
        const int64_t qkv = (H_ + 2 * Hkv_) * D_;
        xn_.resize(max_rows * std::max(hidden, H_ * D_));
        qkv_.resize(max_rows * qkv);
        attn_.resize(max_rows * H_ * D_);
        mid_.resize(max_rows * 2 * intermediate);
        act_.resize(max_rows * intermediate);
        out_.resize(max_rows * hidden);
    }

    // Segments: (data, type, row scales (empty if none), rows) in output order: uint8 tiles of a
    // quantized type or BF16.
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
                (conveyor::is_dense(s.type) ? lin.floats : lin.quantized) = true;
                lin.segments.push_back(s);
            }
            TORCH_CHECK(n0 == N[i], "linear ", i, " has ", n0, " output rows, expected ", N[i]);
            if (biases[i].has_value() && biases[i]->defined()) lin.bias = biases[i]->to(torch::kFloat32).contiguous();
        }
        layers_.push_back(std::move(layer));
    }

    // x [B, hidden] fp32 (updated in place and returned); cos/sin [B, D] fp32; per layer its KV cache
    // [2, slots, Hkv, D]; per layer group its decode block tables [B, width], context lengths [B], the
    // slots [B] the new K/V go to and its sliding window (0: none; its tables are then rings of that
    // many slots); the rows' positions [B]; `threads` <= 0: torch's intra-op thread count.
    // `shared_rows`: some request has several rows (speculative proposals): every row's K/V is stored
    // before any row attends.
    torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kv,
                          std::vector<torch::Tensor> tables, std::vector<torch::Tensor> lens,
                          std::vector<torch::Tensor> slots, std::vector<int64_t> windows, torch::Tensor positions,
                          int64_t page_size, int64_t threads, bool shared_rows) {
        const int64_t B = x.size(0);
        TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) == hidden_, "x must be fp32 [B, hidden]");
        TORCH_CHECK(B >= 1 && B <= max_rows_, "the stack takes 1 to ", max_rows_, " rows, got ", B);
        TORCH_CHECK(kv.size() == layers_.size(), "one KV cache per layer expected");
        TORCH_CHECK(windows.size() == tables.size() && positions.is_contiguous() &&
                    positions.scalar_type() == torch::kInt64 && positions.numel() == B,
                    "one window per layer group and int64 positions [B] expected");
        TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32, "fp32 cos/sin");
        const auto dtype = kv[0].scalar_type();
        TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "the KV cache must be fp32 or bf16");
        for (auto& t : kv) TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dtype, "contiguous KV caches of one dtype");
        const int nt = static_cast<int>(threads > 0 ? threads : at::get_num_threads());
        if (dtype == torch::kFloat32) run<float>(x, cos, sin, kv, tables, lens, slots, windows, positions, page_size, nt, shared_rows);
        else run<at::BFloat16>(x, cos, sin, kv, tables, lens, slots, windows, positions, page_size, nt, shared_rows);
        return x;
    }

    int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  private:
    // Rows [r0, r1) of this thread's elementwise work: norms, RoPE, K/V writes, SiLU, residual adds
    // and activation quantization touch only their own rows, so they need no barrier among them.
    // With at least one row per thread, each thread also runs its rows' attention right after
    // writing their K/V (after all rows' K/V when rows share a request); with fewer rows (one
    // stream), attention splits the (row, kv head) pairs.
    template <typename T>
    void run(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<torch::Tensor>& kv,
             const std::vector<torch::Tensor>& tables, const std::vector<torch::Tensor>& lens,
             const std::vector<torch::Tensor>& slots, const std::vector<int64_t>& windows,
             const torch::Tensor& positions, int64_t page, int threads, bool shared_rows) {
        const int64_t B = x.size(0), qd = H_ * D_, kvd = Hkv_ * D_, qkv_n = qd + 2 * kvd, G = H_ / Hkv_;
        float* xp = x.data_ptr<float>();
        const float* cp = cos.data_ptr<float>();
        const float* sp = sin.data_ptr<float>();
        const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
        for (auto [act, K] : {std::pair{&act_hidden_, hidden_}, {&act_attn_, qd}, {&act_inter_, inter_}})
            act->shape(B, K), act->shape_floats(B, K);
        const int nt_wanted = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, 64)));
#pragma omp parallel num_threads(nt_wanted)
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t r0 = B * tid / nt, r1 = B * (tid + 1) / nt;
            const bool by_rows = B >= nt;
            conveyor::DecodeScratch scratch;
            const auto prepare = [&](const Linear& lin, const float* in, int64_t K, Activations& act) {  // rows r0..r1
                if (lin.quantized) conveyor::quantize_rows(in, K, r0, r1, act);
                if (lin.floats) conveyor::pack_float_rows(in, K, r0, r1, act);
            };
            const auto matmul = [&](const Linear& lin, const Activations& act, float* out, int64_t ld) {
                lin.run(act, out, ld, tid, nt);
            };
            for (int64_t b = r0; b < r1; ++b)
                conveyor::rms_norm_row<T>(xp + b * hidden_, layers_[0].input_norm.data_ptr<float>(), hidden_, eps,
                                          xn_.data() + b * hidden_);
            prepare(layers_[0].qkv, xn_.data(), hidden_, act_hidden_);
            for (size_t l = 0; l < layers_.size(); ++l) {
                const Layer& L = layers_[l];
                T* kc = kv[l].template data_ptr<T>();
                T* vc = kc + kv[l].size(1) * kvd;
                const int64_t* slot = slots[L.group].data_ptr<int64_t>();
                const int64_t* bt = tables[L.group].data_ptr<int64_t>();
                const int64_t width = tables[L.group].size(1);
                const int64_t* len = lens[L.group].data_ptr<int64_t>();
                const int64_t window = windows[L.group];
                const int64_t* pos = positions.data_ptr<int64_t>();
                const auto attend = [&](int64_t b, int64_t g0, int64_t g1) {  // kv heads [g0, g1) of row b
                    const int64_t first = window > 0 ? pos[b] - len[b] + 1 : 0;  // a ring holds the window's positions
                    conveyor::attend_request<T>(qkv_.data() + b * qkv_n + g0 * G * D_, kc, vc, bt + b * width, len[b],
                                                first, window, page, Hkv_, D_, G, g0, g1, scale, 0.f, nullptr, scratch,
                                                attn_.data() + b * qd + g0 * G * D_);
                    round_row<T>(attn_.data() + b * qd + g0 * G * D_, (g1 - g0) * G * D_);
                };
                const auto rope_and_store = [&](int64_t b) {
                    float* row = qkv_.data() + b * qkv_n;
                    L.qkv.add_bias_row(row);
                    round_row<T>(row, qkv_n);
                    for (int64_t h = 0; h < H_ + Hkv_; ++h)  // q heads, then k heads
                        conveyor::rope_head<T>(row + h * D_, cp + b * D_, sp + b * D_, D_);
                    store_row(kc + slot[b] * kvd, row + qd, kvd);
                    store_row(vc + slot[b] * kvd, row + qd + kvd, kvd);
                };
#pragma omp barrier
                matmul(L.qkv, act_hidden_, qkv_.data(), qkv_n);
#pragma omp barrier
                if (by_rows && shared_rows) {  // a row may read what another thread's row stores
                    for (int64_t b = r0; b < r1; ++b) rope_and_store(b);
#pragma omp barrier
                    for (int64_t b = r0; b < r1; ++b) attend(b, 0, Hkv_);
                } else if (by_rows) {
                    for (int64_t b = r0; b < r1; ++b) {
                        rope_and_store(b);
                        attend(b, 0, Hkv_);
                    }
                } else {
                    if (tid == 0)
                        for (int64_t b = 0; b < B; ++b) rope_and_store(b);
#pragma omp barrier
                    const int64_t pairs = B * Hkv_, p0 = pairs * tid / nt, p1 = pairs * (tid + 1) / nt;
                    for (int64_t p = p0; p < p1;) {  // runs of kv heads of one row
                        const int64_t b = p / Hkv_, g1 = std::min(p1, (b + 1) * Hkv_);
                        attend(b, p % Hkv_, g1 - b * Hkv_);
                        p = g1;
                    }
#pragma omp barrier
                }
                prepare(L.o, attn_.data(), qd, act_attn_);
#pragma omp barrier
                matmul(L.o, act_attn_, out_.data(), hidden_);
#pragma omp barrier
                for (int64_t b = r0; b < r1; ++b) {
                    L.o.add_bias_row(out_.data() + b * hidden_);
                    round_row<T>(out_.data() + b * hidden_, hidden_);
                    add_row<T>(xp + b * hidden_, out_.data() + b * hidden_, hidden_);
                    conveyor::rms_norm_row<T>(xp + b * hidden_, L.post_norm.data_ptr<float>(), hidden_, eps,
                                              xn_.data() + b * hidden_);
                }
                prepare(L.gate_up, xn_.data(), hidden_, act_hidden_);
#pragma omp barrier
                matmul(L.gate_up, act_hidden_, mid_.data(), 2 * inter_);
#pragma omp barrier
                for (int64_t b = r0; b < r1; ++b) {
                    float* gate = mid_.data() + b * 2 * inter_;
                    L.gate_up.add_bias_row(gate);
                    round_row<T>(gate, 2 * inter_);
                    conveyor::silu_mul_row<T>(gate, gate + inter_, inter_, act_.data() + b * inter_);
                }
                prepare(L.down, act_.data(), inter_, act_inter_);
#pragma omp barrier
                matmul(L.down, act_inter_, out_.data(), hidden_);
#pragma omp barrier
                const Layer* next = l + 1 < layers_.size() ? &layers_[l + 1] : nullptr;
                for (int64_t b = r0; b < r1; ++b) {  // the residual add, then the next layer's input norm
                    L.down.add_bias_row(out_.data() + b * hidden_);
                    round_row<T>(out_.data() + b * hidden_, hidden_);
                    add_row<T>(xp + b * hidden_, out_.data() + b * hidden_, hidden_);
                    if (next)
                        conveyor::rms_norm_row<T>(xp + b * hidden_, next->input_norm.data_ptr<float>(), hidden_, eps,
                                                  xn_.data() + b * hidden_);
                }
                if (next) prepare(next->qkv, xn_.data(), hidden_, act_hidden_);
            }
        }
    }

    int64_t hidden_, inter_, H_, Hkv_, D_;
    double eps_, scale_;
    int64_t max_rows_;
    std::vector<Layer> layers_;
    std::vector<float> xn_, qkv_, attn_, mid_, act_, out_;
    Activations act_hidden_, act_attn_, act_inter_;
};

void register_decode_stack(py::module_& m) {
    py::class_<DecodeStack>(m, "DecodeStack")
        .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t>())
        .def("add_layer", &DecodeStack::add_layer)
        .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
