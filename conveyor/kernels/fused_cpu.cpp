// Fused elementwise ops of the Llama decoder layer on CPU (fp32 or bf16): RMSNorm, rotary
// embedding (in place) and SiLU(gate) * up, each one pass instead of the 3-10 small PyTorch ops it
// replaces (at decode batch sizes those ops cost more in dispatch and thread fork/join than in
// arithmetic). Each op rounds like the PyTorch sequence it replaces (built with -ffp-contract=off:
// no fused multiply-adds); only RMSNorm's sum of squares is added in another order. bf16 inputs
// are computed in fp32 and rounded to bf16 wherever the PyTorch bf16 op would round (SiLU * up:
// once, at the end). AVX-512 (and for SiLU, AVX2) vectors where the CPU has them, the same
// operations in the same order as the scalar loops (SiLU's e^x is a vector polynomial to ~1 ulp
// instead of libm's): a 512-token prefill chunk spent ~9% of its time in scalar expf calls.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

#include "vec_math.h"

using bf16 = at::BFloat16;

// Rows are processed on one thread up to this many (decode batches), split across threads above.
constexpr int64_t kRowGrain = 64;

static inline float to_float(float x) { return x; }
static inline float to_float(bf16 x) { return static_cast<float>(x); }

// x rounded to T, as a PyTorch op on T-typed tensors rounds its result (round to nearest even).
template <typename T>
static inline float round_as(float x) {
    if constexpr (std::is_same_v<T, float>) return x;
    else return static_cast<float>(bf16(x));
}

static void check_float(const torch::Tensor& t, const char* name) {
    TORCH_CHECK((t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16) && t.device().is_cpu(),
                name, " must be an fp32 or bf16 CPU tensor");
}

static void check_same(const torch::Tensor& a, const torch::Tensor& b, const char* name) {
    TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, " must have the input's dtype");
}

// Calls f with a null pointer of the tensor's element type (float or bf16).
template <typename F>
static void dispatch(const torch::Tensor& t, F&& f) {
    if (t.scalar_type() == torch::kFloat32) f(static_cast<float*>(nullptr));
    else f(static_cast<bf16*>(nullptr));
}

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, as transformers' LlamaRMSNorm: the
// statistics in fp32, the normalized x rounded to x's dtype before the product with the weight.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
    check_float(x, "x");
    check_float(weight, "weight");
    check_same(x, weight, "weight");
    x = x.contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "weight must be contiguous with ", n, " elements");
    auto out = torch::empty_like(x);
    const float feps = static_cast<float>(eps), fn = static_cast<float>(n);
    dispatch(x, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        const T* xp = x.data_ptr<T>();
        const T* w = weight.data_ptr<T>();
        T* op = out.data_ptr<T>();
        at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const T* xr = xp + r * n;
                float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                int64_t i = 0;
                for (; i + 8 <= n; i += 8)
                    for (int l = 0; l < 8; ++l) part[l] += to_float(xr[i + l]) * to_float(xr[i + l]);
                float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
                for (; i < n; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
                const float inv = 1.f / std::sqrt(ss / fn + feps);
                T* orow = op + r * n;
                int64_t j = 0;
#if defined(__AVX512F__)
                const __m512 iv = _mm512_set1_ps(inv);
                for (; j + 16 <= n; j += 16) {
                    __m512 v = _mm512_mul_ps(conveyor::load16(xr + j), iv);
                    if constexpr (!std::is_same_v<T, float>) v = conveyor::round_bf16(v);
                    conveyor::store16(orow + j, _mm512_mul_ps(conveyor::load16(w + j), v));
                }
#endif
                for (; j < n; ++j) orow[j] = T(to_float(w[j]) * round_as<T>(to_float(xr[j]) * inv));
            }
        });
    });
    return out;
}

// x * cos + rotate_half(x) * sin, in place: x is [tokens, heads, dim] with contiguous heads (a view
// into the fused qkv output is fine), cos and sin [tokens, dim] of x's dtype. In bf16 each product
// and the sum round to bf16, as the PyTorch expression does.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
    check_float(x, "x");
    check_same(x, cos, "cos");
    check_same(x, sin, "sin");
    TORCH_CHECK(cos.device().is_cpu() && sin.device().is_cpu(), "cos and sin must be CPU tensors");
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [tokens, heads, dim] "
                "with contiguous heads");
    cos = cos.contiguous();
    sin = sin.contiguous();
    const int64_t tokens = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, row = x.stride(0);
    TORCH_CHECK(cos.numel() == tokens * D && sin.numel() == tokens * D, "cos and sin must be [tokens, dim]");
    dispatch(x, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        T* xp = x.data_ptr<T>();
        const T* cp = cos.data_ptr<T>();
        const T* sp = sin.data_ptr<T>();
        at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                const T* c = cp + t * D;
                const T* s = sp + t * D;
                for (int64_t h = 0; h < H; ++h) {
                    T* v = xp + t * row + h * D;
                    int64_t i = 0;
#if defined(__AVX512F__)
                    for (; i < half; i += 16) {
                        const __mmask16 m = static_cast<__mmask16>(half - i >= 16 ? 0xFFFF : (1u << (half - i)) - 1);
                        const __m512 x1 = conveyor::load16(v + i, m), x2 = conveyor::load16(v + half + i, m);
                        const __m512 c1 = conveyor::load16(c + i, m), c2 = conveyor::load16(c + half + i, m);
                        const __m512 s1 = conveyor::load16(s + i, m), s2 = conveyor::load16(s + half + i, m);
                        __m512 a = _mm512_mul_ps(x1, c1), b = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1);
                        __m512 e = _mm512_mul_ps(x2, c2), f = _mm512_mul_ps(x1, s2);
                        if constexpr (!std::is_same_v<T, float>)
                            a = conveyor::round_bf16(a), b = conveyor::round_bf16(b), e = conveyor::round_bf16(e),
                            f = conveyor::round_bf16(f);
                        conveyor::store16(v + i, _mm512_add_ps(a, b), m);
                        conveyor::store16(v + half + i, _mm512_add_ps(e, f), m);
                    }
#endif
                    for (; i < half; ++i) {
                        const float x1 = to_float(v[i]), x2 = to_float(v[i + half]);
                        v[i] = T(round_as<T>(x1 * to_float(c[i])) + round_as<T>((-x2) * to_float(s[i])));
                        v[i + half] =
                            T(round_as<T>(x2 * to_float(c[i + half])) + round_as<T>(x1 * to_float(s[i + half])));
                    }
                }
            }
        });
    });
}

// silu(gate) * up for gate_up = [gate | up] along the last dimension (bf16: in fp32, rounded once).
torch::Tensor silu_mul(torch::Tensor gate_up) {
    check_float(gate_up, "gate_up");
    gate_up = gate_up.contiguous();
    const int64_t width = gate_up.size(-1), n = width / 2, rows = gate_up.numel() / width;
    auto sizes = gate_up.sizes().vec();
    sizes.back() = n;
    auto out = torch::empty(sizes, gate_up.options());
    dispatch(gate_up, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        const T* gp = gate_up.data_ptr<T>();
        T* op = out.data_ptr<T>();
        at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const T* g = gp + r * width;
                const T* u = g + n;
                T* o = op + r * n;
                int64_t i = 0;
#if defined(__AVX512F__)
                const __m512 one = _mm512_set1_ps(1.f);
                for (; i + 16 <= n; i += 16) {
                    const __m512 gi = conveyor::load16(g + i);
                    const __m512 e = conveyor::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gi));
                    conveyor::store16(o + i, _mm512_mul_ps(_mm512_div_ps(gi, _mm512_add_ps(one, e)), conveyor::load16(u + i)));
                }
#elif defined(__AVX2__) && defined(__FMA__)
                if constexpr (std::is_same_v<T, float>) {
                    const __m256 one = _mm256_set1_ps(1.f);
                    for (; i + 8 <= n; i += 8) {
                        const __m256 gi = _mm256_loadu_ps(g + i);
                        const __m256 e = conveyor::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi));
                        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gi, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
                    }
                }
#endif
                for (; i < n; ++i) {
                    const float gi = to_float(g[i]);
                    o[i] = T(gi / (1.f + std::exp(-gi)) * to_float(u[i]));
                }
            }
        });
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (fp32 or bf16, CPU)");
    m.def("rope_", &rope_, "rotary embedding in place (fp32 or bf16, CPU)");
    m.def("silu_mul", &silu_mul, "silu(gate) * up (fp32 or bf16, CPU)");
}
