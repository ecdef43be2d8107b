// Fused elementwise ops of the Llama decoder layer on CPU (fp32 or bf16): RMSNorm, rotary
// embedding (in place) and SiLU(gate) * up, each one pass instead of the 3-10 small PyTorch ops it
// replaces (at decode batch sizes those ops cost more in dispatch and thread fork/join than in
// arithmetic). Each op rounds like the PyTorch sequence it replaces (built with -ffp-contract=off:
// no fused multiply-adds); only RMSNorm's sum of squares is added in another order. bf16 inputs
// are computed in fp32 and rounded to bf16 wherever the PyTorch bf16 op would round (SiLU * up:
// once, at the end). AVX-512 (and for SiLU, AVX2) vectors where the CPU has them, the same
// operations in the same order as the scalar loops (SiLU's e^x is a vector polynomial to ~1 ulp
// instead of libm's): a 512-token prefill chunk spent ~9% of its time in scalar expf calls. The
// per-row arithmetic is row_ops.h's, which the native decode stack runs too: a row gets the same bits
// on either path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <type_traits>

#include "row_ops.h"

using bf16 = at::BFloat16;

// Rows are processed on one thread up to this many (decode batches), split across threads above.
constexpr int64_t kRowGrain = 64;

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
    const float feps = static_cast<float>(eps);
    dispatch(x, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        const T* xp = x.data_ptr<T>();
        const T* w = weight.data_ptr<T>();
        T* op = out.data_ptr<T>();
        at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) conveyor::rms_norm_row<T>(xp + r * n, w, n, feps, op + r * n);
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
    const int64_t tokens = x.size(0), H = x.size(1), D = x.size(2), row = x.stride(0);
    TORCH_CHECK(cos.numel() == tokens * D && sin.numel() == tokens * D, "cos and sin must be [tokens, dim]");
    dispatch(x, [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        T* xp = x.data_ptr<T>();
        const T* cp = cos.data_ptr<T>();
        const T* sp = sin.data_ptr<T>();
        at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t)
                for (int64_t h = 0; h < H; ++h) conveyor::rope_head<T>(xp + t * row + h * D, cp + t * D, sp + t * D, D);
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
                conveyor::silu_mul_row<T>(g, g + n, n, op + r * n);
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
