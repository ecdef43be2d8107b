// The GEMM microkernel `tile_rows<T, MR>` for the plain C++ path.
// Included by quant_gemm.cpp inside its namespaces, after the helpers it uses.
#pragma once

// One output at a time: the reference of the vector paths' arithmetic.
constexpr int kPassRows = 1;

template <int64_t T, int MR>
void tile_rows(const uint8_t* tile, const float* scales, const Activations& a, int64_t m0, int64_t n0, int64_t N,
               const TileOut& out) {
    const int64_t valid = std::min<int64_t>(kTileRows, N - n0);
    for (int i = 0; i < MR; ++i) {
        const int64_t m = m0 + i;
        for (int r = 0; r < valid; ++r) {
            float acc = 0.f;
            if constexpr (T == BF16 || T == F32) {
                using W = std::conditional_t<T == F32, float, bf16>;
                const W* w = reinterpret_cast<const W*>(tile) + r;
                const int64_t g0 = Activations::group_start(m), rows = a.group_rows(g0);
                for (int64_t k = 0; k < a.K; ++k) acc += static_cast<float>(w[k * kTileRows]) * a.f[g0 * a.K + k * rows + m - g0];
                out.store(m, n0 + r, acc);
                continue;
            }
            for (int64_t b = 0; b < a.nb; ++b) {
                const uint8_t* blk = tile_block(T, tile, b);
                const float xd = a.d[a.at(m, b)];
                for (int h = 0; h < 2; ++h) {  // halves: the scales of Q2_K, Q3_K and Q6_K differ
                    int dot = 0, sum = 0;
                    for (int e = 16 * h; e < 16 * h + 16; ++e) {
                        const int v = a.value(m, b, e);
                        dot += tiled_weight(T, blk, r, e) * v, sum += v;
                    }
                    float d, mn;  // w = d q + mn for this half block
                    const uint8_t* sc = blk + quant_bytes(T);
                    const uint8_t* head = tile_header(T, tile, b);
                    switch (T) {
                        case Q4_0: d = half_to_float(fp16_scales(sc)[r]), mn = -8.f * d; break;
                        case Q4_1: d = half_to_float(fp16_scales(sc)[r]), mn = half_to_float(fp16_scales(sc)[16 + r]); break;
                        case Q8_0: d = half_to_float(fp16_scales(sc)[r]), mn = 0.f; break;
                        case Q2_K:
                            d = half_to_float(fp16_scales(head)[r]) * (sc[16 * h + r] & 0xF);
                            mn = -(half_to_float(fp16_scales(head)[16 + r]) * (sc[16 * h + r] >> 4));
                            break;
                        case Q3_K: d = half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[16 * h + r]), mn = 0.f; break;
                        case Q4_K:
                        case Q5_K:
                            d = half_to_float(fp16_scales(head)[r]) * sc[r];
                            mn = -(half_to_float(fp16_scales(head)[16 + r]) * sc[16 + r]);
                            break;
                        case Q6_K: d = half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[16 * h + r]), mn = 0.f; break;
                        case IQ4_NL:
                        case MXFP4: d = half_to_float(fp16_scales(sc)[r]), mn = 0.f; break;
                        case IQ4_XS: d = half_to_float(fp16_scales(head)[r]) * static_cast<int8_t>(sc[r]), mn = 0.f; break;
                        default: d = 1.f, mn = 0.f;
                    }
                    acc += d * xd * dot + mn * xd * sum;
                }
            }
            out.store(m, n0 + r, scales ? acc * scales[n0 + r] : acc);
        }
    }
}
