// Fused elementwise ops of the Llama decoder layer on CPU (fp32): RMSNorm, rotary embedding (in
// place) and SiLU(gate) * up, each one pass instead of the 3-10 small PyTorch ops it replaces (at
// decode batch sizes those ops cost more in dispatch and thread fork/join than in arithmetic).
// Each op rounds like the PyTorch sequence it replaces (built with -ffp-contract=off: no fused
// multiply-adds); only RMSNorm's sum of squares is added in another order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

// Rows are processed on one thread up to this many (decode batches), split across threads above.
constexpr int64_t kRowGrain = 64;

static void check_fp32(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(), name, " must be an fp32 CPU tensor");
}

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, as transformers' LlamaRMSNorm in fp32.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
    check_fp32(x, "x");
    check_fp32(weight, "weight");
    x = x.contiguous();
    const int64_t n = x.size(-1), rows = x.numel() / n;
    TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "weight must be contiguous with ", n, " elements");
    auto out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* w = weight.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float feps = static_cast<float>(eps), fn = static_cast<float>(n);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float* xr = xp + r * n;
            float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            int64_t i = 0;
            for (; i + 8 <= n; i += 8)
                for (int l = 0; l < 8; ++l) part[l] += xr[i + l] * xr[i + l];
            float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
            for (; i < n; ++i) ss += xr[i] * xr[i];
            const float inv = 1.f / std::sqrt(ss / fn + feps);
            float* orow = op + r * n;
            for (int64_t j = 0; j < n; ++j) orow[j] = w[j] * (xr[j] * inv);
        }
    });
    return out;
}

// x * cos + rotate_half(x) * sin, in place: x is [tokens, heads, dim] with contiguous heads (a view
// into the fused qkv output is fine), cos and sin [tokens, dim].
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
    check_fp32(x, "x");
    check_fp32(cos, "cos");
    check_fp32(sin, "sin");
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [tokens, heads, dim] "
                "with contiguous heads");
    cos = cos.contiguous();
    sin = sin.contiguous();
    const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, row = x.stride(0);
    TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D, "cos and sin must be [tokens, dim]");
    float* xp = x.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, T, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float* c = cp + t * D;
            const float* s = sp + t * D;
            for (int64_t h = 0; h < H; ++h) {
                float* v = xp + t * row + h * D;
                for (int64_t i = 0; i < half; ++i) {
                    const float x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * c[i] + (-x2) * s[i];
                    v[i + half] = x2 * c[i + half] + x1 * s[i + half];
                }
            }
        }
    });
}

// silu(gate) * up for gate_up = [gate | up] along the last dimension.
torch::Tensor silu_mul(torch::Tensor gate_up) {
    check_fp32(gate_up, "gate_up");
    gate_up = gate_up.contiguous();
    const int64_t width = gate_up.size(-1), n = width / 2, rows = gate_up.numel() / width;
    auto sizes = gate_up.sizes().vec();
    sizes.back() = n;
    auto out = torch::empty(sizes, gate_up.options());
    const float* gp = gate_up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float* g = gp + r * width;
            const float* u = g + n;
            float* o = op + r * n;
            for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
        }
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (fp32, CPU)");
    m.def("rope_", &rope_, "rotary embedding in place (fp32, CPU)");
    m.def("silu_mul", &silu_mul, "silu(gate) * up (fp32, CPU)");
}
