/* Paged decode attention for x86 CPUs with AVX-512, float32 or bfloat16 (BF16=1) pools and
 * queries, computed in float32 (titanrl/generator/cpu_kernel.py).
 *
 * One query token per row attends to the row's positions 0..pos[n] through its block table.
 * Layouts are the generator's KV pool with keys transposed (KVCachePool(k_transposed=True)):
 *   q     [N, G, R, HEAD_DIM]       G KV heads, R query heads each
 *   k     [pages, G, HEAD_DIM, BLOCK] a page's keys contiguous per feature
 *   v     [pages, BLOCK, G, HEAD_DIM]
 *   table [N, M] int64, pos [N] int64, out [N, G, R, HEAD_DIM]
 * BLOCK and HEAD_DIM are compile-time multiples of 16 (one zmm register holds 16 floats): a
 * page's scores for one feature and a value row are whole registers, and the loops unroll.
 * Each (row, KV head) is computed alone in a fixed order, so a row's result does not depend on
 * the batch it is in, nor on the thread count. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if BF16
/* bfloat16 in memory: the high half of a float32. Loads widen 16 at a time; the output is
 * rounded to nearest-even, as c10::BFloat16's scalar conversion (NaN -> 0x7FC0). */
typedef uint16_t elem_t;
static inline __m512 load16(const elem_t* p) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline float load1(const elem_t* p) {
  const uint32_t u = (uint32_t)*p << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline void store16(elem_t* p, __m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000)); /* NaN */
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#else
typedef float elem_t;
static inline __m512 load16(const elem_t* p) { return _mm512_loadu_ps(p); }
static inline float load1(const elem_t* p) { return *p; }
static inline void store16(elem_t* p, __m512 x) { _mm512_storeu_ps(p, x); }
#endif

#define SV (BLOCK / 16)                   /* registers per page of scores */
#define DV (HEAD_DIM / 16)                /* registers per head vector */
#define KS (SV >= 4 ? 1 : 4 / SV)         /* independent FMA chains: FMA latency ~4 cycles */
#define KV (DV >= 4 ? 1 : 4 / DV)
/* Pages fetched ahead of use: ~32 KB of K and V in flight (of a 1-2 MB L2), at least one page. */
#define PAGE_BYTES (2 * HEAD_DIM * BLOCK * (int)sizeof(elem_t))
#define AHEAD (32768 / PAGE_BYTES > 0 ? (32768 / PAGE_BYTES) : 1)

/* glibc's libmvec: expf on 16 lanes (AVX-512 variant). */
__m512 _ZGVeN16v_expf(__m512);

static void page_scores(const elem_t* qg, const elem_t* kpage, int64_t R, float scale, float* scores,
                        int64_t stride) {
  for (int64_t r = 0; r < R; r++) {
    const elem_t* qr = qg + r * HEAD_DIM;
    for (int c = 0; c < SV; c++) {
      __m512 acc[KS];
      for (int k = 0; k < KS; k++) acc[k] = _mm512_setzero_ps();
      for (int d = 0; d < HEAD_DIM; d += KS)
        for (int k = 0; k < KS; k++)
          acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(load1(qr + d + k)), load16(kpage + (d + k) * BLOCK + c * 16),
                                   acc[k]);
      for (int k = 1; k < KS; k++) acc[0] = _mm512_add_ps(acc[0], acc[k]);
      _mm512_storeu_ps(scores + r * stride + c * 16, _mm512_mul_ps(acc[0], _mm512_set1_ps(scale)));
    }
  }
}

/* The lanes of scores i..i+15 that are among the first `valid`. */
static inline __mmask16 valid_lanes(int64_t i, int64_t valid) {
  return i + 16 <= valid ? (__mmask16)0xFFFF : (i < valid ? (__mmask16)((1u << (valid - i)) - 1) : (__mmask16)0);
}

/* exp(s - max) of the first `valid` of `len` scores (a multiple of 16), in place; the rest
 * become 0. Returns the sum. Masked lanes enter expf as 0 and the others are clamped at -87 (the
 * result stays a normal float): libmvec's expf takes a slow scalar path for lanes out of range.
 * A NaN score makes the sum NaN, as in a reference softmax (max(lo, x) returns x if x is NaN). */
static float softmax_unnormalised(float* s, int64_t valid, int64_t len) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < len; i += 16)
    mx = _mm512_mask_max_ps(mx, valid_lanes(i, valid), mx, _mm512_loadu_ps(s + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  const __m512 lo = _mm512_set1_ps(-87.0f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < len; i += 16) {
    const __mmask16 in = valid_lanes(i, valid);
    const __m512 x = _mm512_max_ps(lo, _mm512_maskz_sub_ps(in, _mm512_loadu_ps(s + i), m));
    const __m512 e = _mm512_maskz_mov_ps(in, _ZGVeN16v_expf(x));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

static void weighted_values(const float* p, const elem_t* vp, const int64_t* tab, int64_t pages, int64_t G,
                            int64_t g, float inv_sum, elem_t* out) {
  __m512 acc[KV][DV];
  for (int k = 0; k < KV; k++)
    for (int j = 0; j < DV; j++) acc[k][j] = _mm512_setzero_ps();
  for (int64_t m = 0; m < pages; m++) {
    const elem_t* vpage = vp + (tab[m] * BLOCK * G + g) * HEAD_DIM;
    for (int b = 0; b < BLOCK; b += KV)
      for (int k = 0; k < KV; k++) {
        const __m512 w = _mm512_set1_ps(p[m * BLOCK + b + k]);
        for (int j = 0; j < DV; j++)
          acc[k][j] = _mm512_fmadd_ps(w, load16(vpage + (b + k) * G * HEAD_DIM + j * 16), acc[k][j]);
      }
  }
  for (int j = 0; j < DV; j++) {
    for (int k = 1; k < KV; k++) acc[0][j] = _mm512_add_ps(acc[0][j], acc[k][j]);
    store16(out + j * 16, _mm512_mul_ps(acc[0][j], _mm512_set1_ps(inv_sum)));
  }
}

/* A row's pages are scattered over the pool, so each new page would start with a miss to L3 or
 * memory (a step reads every row's KV once; at real sizes it does not stay in cache between
 * steps). K and V pages are asked for into L2 ahead of use: the next row's first pages while
 * this row computes, and within a row the page AHEAD places further. The kernel alone
 * (scripts/bench_decode_attention.py shapes, against the same code without): 1.1-1.9x at
 * head_dim 64-128, most with long rows; 3-7% slower at head_dim 16 with the pool already in
 * cache. (The helper must be inlined: GCC otherwise finds it free of side effects and drops
 * its calls.) */
static inline __attribute__((always_inline)) void prefetch_page(const elem_t* kp, const elem_t* vp, int64_t page,
                                                                int64_t G, int64_t g) {
  const char* k = (const char*)(kp + (page * G + g) * HEAD_DIM * BLOCK);
  for (int l = 0; l < HEAD_DIM * BLOCK * (int)sizeof(elem_t); l += 64) _mm_prefetch(k + l, _MM_HINT_T1);
  for (int b = 0; b < BLOCK; b++) {
    const char* v = (const char*)(vp + ((page * BLOCK + b) * G + g) * HEAD_DIM);
    for (int l = 0; l < HEAD_DIM * (int)sizeof(elem_t); l += 64) _mm_prefetch(v + l, _MM_HINT_T1);
  }
}

void titanrl_paged_decode_attention(const elem_t* q, const elem_t* kp, const elem_t* vp, const int64_t* table,
                                    const int64_t* pos, elem_t* out, int64_t N, int64_t G, int64_t R, int64_t M,
                                    float scale, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int64_t stride = M * BLOCK;
    float* scores = aligned_alloc(64, sizeof(float) * R * stride);
#pragma omp for schedule(dynamic, 8) /* rows differ in length */
    for (int64_t ng = 0; ng < N * G; ng++) {
      const int64_t n = ng / G, g = ng % G;
      const int64_t L = pos[n] + 1;
      int64_t pages = (L + BLOCK - 1) / BLOCK;
      if (pages > M) pages = M; /* the table covers every position the step reads */
      const int64_t* tab = table + n * M;
      const elem_t* qg = q + ng * R * HEAD_DIM;
      if (ng + 1 < N * G) {
        const int64_t n1 = (ng + 1) / G;
        for (int64_t m = 0; m < AHEAD && m < M && m * BLOCK <= pos[n1]; m++)
          prefetch_page(kp, vp, table[n1 * M + m], G, (ng + 1) % G);
      }
      for (int64_t m = 0; m < pages; m++) {
        if (m + AHEAD < pages) prefetch_page(kp, vp, tab[m + AHEAD], G, g);
        page_scores(qg, kp + (tab[m] * G + g) * HEAD_DIM * BLOCK, R, scale, scores + m * BLOCK, stride);
      }
      for (int64_t r = 0; r < R; r++) {
        float* s = scores + r * stride;
        const float sum = softmax_unnormalised(s, L < pages * BLOCK ? L : pages * BLOCK, pages * BLOCK);
        weighted_values(s, vp, tab, pages, G, g, 1.0f / sum, out + (ng * R + r) * HEAD_DIM);
      }
    }
    free(scores);
  }
}
