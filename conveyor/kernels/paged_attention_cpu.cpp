// Decode attention straight from the paged KV cache on CPU (fp32).
//
// One query token per request. Every query head is scored against the request's cached keys,
// softmaxed and used to weight the values, reading K/V from the pages in place, without first
// gathering them into a contiguous copy (which costs a full extra read and write of the context
// per layer). `softcap` > 0 caps the scores as Gemma 2 does:
// tanh(score / softcap) * softcap; 0 leaves them alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// 8 floats: one AVX register where the machine has AVX (GCC/Clang vector extension, portable).
typedef float vec8 __attribute__((vector_size(32)));

static inline vec8 load8(const float* p) {
    vec8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(vec8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

// s[t] = q . rows[t][off:off+D] for every token t; D a multiple of 8.
static void head_scores(const float* q, const float* const* rows, int64_t off, int64_t len, int64_t D, float* s) {
    int64_t t = 0;
    for (; t + 4 <= len; t += 4) {
        const float *r0 = rows[t] + off, *r1 = rows[t + 1] + off, *r2 = rows[t + 2] + off, *r3 = rows[t + 3] + off;
        vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t d = 0; d < D; d += 8) {
            const vec8 qv = load8(q + d);
            a0 += qv * load8(r0 + d);
            a1 += qv * load8(r1 + d);
            a2 += qv * load8(r2 + d);
            a3 += qv * load8(r3 + d);
        }
        s[t] = hsum(a0);
        s[t + 1] = hsum(a1);
        s[t + 2] = hsum(a2);
        s[t + 3] = hsum(a3);
    }
    for (; t < len; ++t) {
        vec8 a = {};
        for (int64_t d = 0; d < D; d += 8) a += load8(q + d) * load8(rows[t] + off + d);
        s[t] = hsum(a);
    }
}

// out[0:D] = sum_t p[t] * rows[t][off:off+D]; D a multiple of 8. Strips of 32 (or 8) outputs stay
// in registers over the whole loop on t.
static void head_output(const float* p, const float* const* rows, int64_t off, int64_t len, int64_t D, float* out) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
        for (int64_t t = 0; t < len; ++t) {
            const float* v = rows[t] + off + d0;
            const float w = p[t];
            a0 += w * load8(v);
            a1 += w * load8(v + 8);
            a2 += w * load8(v + 16);
            a3 += w * load8(v + 24);
        }
        std::memcpy(out + d0, &a0, sizeof a0);
        std::memcpy(out + d0 + 8, &a1, sizeof a1);
        std::memcpy(out + d0 + 16, &a2, sizeof a2);
        std::memcpy(out + d0 + 24, &a3, sizeof a3);
    }
    for (; d0 < D; d0 += 8) {
        vec8 a = {};
        for (int64_t t = 0; t < len; ++t) a += p[t] * load8(rows[t] + off + d0);
        std::memcpy(out + d0, &a, sizeof a);
    }
}

torch::Tensor paged_decode_attention(torch::Tensor q,             // [B, H, D]
                                     torch::Tensor kv_cache,      // [2, slots, Hkv, D]
                                     torch::Tensor block_tables,  // [B, max_blocks] int64
                                     torch::Tensor context_lens,  // [B] int64
                                     int64_t page_size, double scale, double softcap) {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kv_cache.scalar_type() == torch::kFloat32, "fp32 only");
    TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                context_lens.is_contiguous(), "contiguous inputs only");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
    const int64_t slots = kv_cache.size(1), Hkv = kv_cache.size(2);
    const int64_t G = H / Hkv, max_blocks = block_tables.size(1);  // G query heads share a kv head
    auto out = torch::empty_like(q);
    const float* qp = q.data_ptr<float>();
    const float* kp = kv_cache.data_ptr<float>();
    const float* vp = kp + slots * Hkv * D;
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    float* op = out.data_ptr<float>();
    const float fscale = static_cast<float>(scale);
    const float fcap = static_cast<float>(softcap);

    // One task per request. Its row pointers (a token's K or V row holds every kv head) are looked
    // up once; then each query head is scored four tokens at a time (four independent 8-wide
    // accumulators, so the FMA latency is hidden), softmaxed, and its output accumulated in 32-wide
    // strips kept in registers while the request's V rows (in L2 by then) stream past.
    const bool vectorized = D % 8 == 0;
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        std::vector<const float*> krows, vrows;
        for (int64_t b = begin; b < end; ++b) {
            const int64_t len = lens[b];
            scores.resize(H * len);
            krows.resize(len);
            vrows.resize(len);
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = bt[b * max_blocks + t / page_size] * page_size + t % page_size;
                krows[t] = kp + slot * Hkv * D;
                vrows[t] = vp + slot * Hkv * D;
            }
            const float* qb = qp + b * H * D;
            float* ob = op + b * H * D;
            for (int64_t h = 0; h < H; ++h) {
                const int64_t off = (h / G) * D;
                float* s = scores.data() + h * len;
                if (vectorized) {
                    head_scores(qb + h * D, krows.data(), off, len, D, s);
                } else {
                    for (int64_t t = 0; t < len; ++t) {
                        float dot = 0.f;
                        for (int64_t d = 0; d < D; ++d) dot += qb[h * D + d] * krows[t][off + d];
                        s[t] = dot;
                    }
                }
                float mx = -std::numeric_limits<float>::infinity();
                for (int64_t t = 0; t < len; ++t) {
                    const float score = s[t] * fscale;
                    s[t] = fcap > 0.f ? std::tanh(score / fcap) * fcap : score;
                    mx = std::max(mx, s[t]);
                }
                float sum = 0.f;
                for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - mx));
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < len; ++t) s[t] *= inv;
                if (vectorized) {
                    head_output(s, vrows.data(), off, len, D, ob + h * D);
                } else {
                    for (int64_t d = 0; d < D; ++d) {
                        float acc = 0.f;
                        for (int64_t t = 0; t < len; ++t) acc += s[t] * vrows[t][off + d];
                        ob[h * D + d] = acc;
                    }
                }
            }
        }
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (fp32, CPU)");
}
