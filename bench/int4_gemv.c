/* A hand-written int4 GEMV for AVX-512 VNNI, to measure how close any kernel gets to this machine's read
 * bandwidth: the question behind issue 4's decode target (see docs/benchmarks.md, "int4 decode").
 * Not part of qwen2om: ONNX Runtime could only call it as a custom op, and building one needs ONNX
 * Runtime's C API header, which no registry this project installs from provides.
 *
 *   gcc -O3 -march=native -fopenmp bench/int4_gemv.c -o /tmp/int4_gemv && /tmp/int4_gemv [K N copies threads]
 *
 * y = W x for symmetric int4 W [N, K] in groups of 128 along K with fp32 scales, x quantised to int8 per
 * group (as MatMulNBits' accuracy_level 4 does). Layout: 16 rows interleaved so that one 64-byte load
 * feeds VPDPBUSD with 4 consecutive k of each row (low nibbles) and the next 4 (high nibbles), weights
 * stored as w + 8 (unsigned); the + 8 is taken back with each group's activation sum. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { GROUP = 128, TILE = 16 };

static void gemv_tiles(const uint8_t *wq, const float *ws, const int8_t *xq, const float *xs, const float *x8sum,
                       float *y, int tile0, int tile1, int k) {
  const int groups = k / GROUP;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int32_t *x4 = (const int32_t *)xq;
  for (int t = tile0; t < tile1; t++) {
    const uint8_t *w = wq + (size_t)t * TILE * (k / 2);
    const float *s = ws + (size_t)t * groups * TILE;
    __m512 acc = _mm512_setzero_ps(), offset = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
      /* four accumulators: VPDPBUSD's latency would otherwise serialise the group */
      __m512i d0 = _mm512_setzero_si512(), d1 = d0, d2 = d0, d3 = d0;
      const uint8_t *wg = w + (size_t)g * TILE * GROUP / 2;
      const int32_t *xg = x4 + g * GROUP / 4;
      for (int c = 0; c < GROUP / 8; c += 2) {
        __m512i b0 = _mm512_loadu_si512(wg + c * 64), b1 = _mm512_loadu_si512(wg + c * 64 + 64);
        d0 = _mm512_dpbusd_epi32(d0, _mm512_and_si512(b0, low), _mm512_set1_epi32(xg[2 * c]));
        d1 = _mm512_dpbusd_epi32(d1, _mm512_and_si512(_mm512_srli_epi16(b0, 4), low), _mm512_set1_epi32(xg[2 * c + 1]));
        d2 = _mm512_dpbusd_epi32(d2, _mm512_and_si512(b1, low), _mm512_set1_epi32(xg[2 * c + 2]));
        d3 = _mm512_dpbusd_epi32(d3, _mm512_and_si512(_mm512_srli_epi16(b1, 4), low), _mm512_set1_epi32(xg[2 * c + 3]));
      }
      __m512i d = _mm512_add_epi32(_mm512_add_epi32(d0, d1), _mm512_add_epi32(d2, d3));
      __m512 sv = _mm512_loadu_ps(s + g * TILE);
      acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(xs[g])), sv, acc);
      offset = _mm512_fmadd_ps(sv, _mm512_set1_ps(x8sum[g]), offset);
    }
    _mm512_storeu_ps(y + t * TILE, _mm512_sub_ps(acc, offset));
  }
}

/* Pack w [n, k] (values in [-8, 7]) and scales [n, k / GROUP] into the interleaved layout above. */
static void pack(const int8_t *w, const float *scale, int n, int k, uint8_t *wq, float *ws) {
  const int groups = k / GROUP;
  for (int t = 0; t < n / TILE; t++)
    for (int c = 0; c < k / 8; c++)
      for (int r = 0; r < TILE; r++)
        for (int j = 0; j < 4; j++) {
          const int8_t *row = w + (size_t)(t * TILE + r) * k + c * 8;
          wq[((size_t)t * (k / 8) + c) * 64 + r * 4 + j] = (uint8_t)((row[j] + 8) | ((row[4 + j] + 8) << 4));
        }
  for (int t = 0; t < n / TILE; t++)
    for (int g = 0; g < groups; g++)
      for (int r = 0; r < TILE; r++) ws[((size_t)t * groups + g) * TILE + r] = scale[(size_t)(t * TILE + r) * groups + g];
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int main(int argc, char **argv) {
  const int k = argc > 1 ? atoi(argv[1]) : 1024, n = argc > 2 ? atoi(argv[2]) : 6144;
  const int copies = argc > 3 ? atoi(argv[3]) : 40, threads = argc > 4 ? atoi(argv[4]) : 2;
  if (k % GROUP || n % TILE || copies < 1 || threads < 1) {
    fprintf(stderr, "K must be a multiple of %d, N of %d\n", GROUP, TILE);
    return 2;
  }
  const int groups = k / GROUP, tiles = n / TILE;
  int8_t *w = malloc((size_t)n * k), *xq = aligned_alloc(64, k);
  float *scale = malloc(sizeof(float) * n * groups), *x = malloc(sizeof(float) * k), xs[groups], x8sum[groups];
  float *y = aligned_alloc(64, sizeof(float) * n);
  uint8_t **wq = malloc(sizeof(void *) * copies);
  float **ws = malloc(sizeof(void *) * copies);
  srand(0);
  for (size_t i = 0; i < (size_t)n * k; i++) w[i] = (int8_t)(rand() % 16 - 8);
  for (int i = 0; i < n * groups; i++) scale[i] = 0.001f + 0.01f * rand() / RAND_MAX;
  for (int i = 0; i < k; i++) x[i] = 2.f * rand() / RAND_MAX - 1.f;
  for (int c = 0; c < copies; c++) {  /* distinct copies, together larger than the caches: weights stream */
    wq[c] = aligned_alloc(64, (size_t)n * k / 2);
    ws[c] = aligned_alloc(64, sizeof(float) * n * groups);
    pack(w, scale, n, k, wq[c], ws[c]);
  }
  for (int g = 0; g < groups; g++) {
    float amax = 0.f;
    for (int j = 0; j < GROUP; j++) amax = fmaxf(amax, fabsf(x[g * GROUP + j]));
    xs[g] = amax / 127.f;
    int sum = 0;
    for (int j = 0; j < GROUP; j++) sum += xq[g * GROUP + j] = (int8_t)lrintf(x[g * GROUP + j] / xs[g]);
    x8sum[g] = 8.f * xs[g] * sum;
  }
  gemv_tiles(wq[0], ws[0], xq, xs, x8sum, y, 0, tiles, k);
  double err = 0.0;  /* against the same int8 activations in double precision */
  for (int r = 0; r < n; r++) {
    double ref = 0.0;
    for (int g = 0; g < groups; g++)
      for (int j = 0; j < GROUP; j++)
        ref += (double)scale[(size_t)r * groups + g] * w[(size_t)r * k + g * GROUP + j] * xs[g] * xq[g * GROUP + j];
    err = fmax(err, fabs(ref - y[r]));
  }
  printf("[1, %d] x [%d, %d], %d copies (%.0f MiB of int4), %d threads; max |y - reference| %.2e\n", k, k, n, copies,
         copies * (double)n * k / 2 / (1 << 20), threads, err);
  omp_set_num_threads(threads);
  for (int run = 0; run < 5; run++) {
    const double t0 = now();
    for (int c = 0; c < copies; c++) {
#pragma omp parallel
      {
        const int per = (tiles + omp_get_num_threads() - 1) / omp_get_num_threads();
        const int lo = omp_get_thread_num() * per, hi = lo + per < tiles ? lo + per : tiles;
        if (lo < hi) gemv_tiles(wq[c], ws[c], xq, xs, x8sum, y, lo, hi, k);
      }
    }
    const double s = (now() - t0) / copies;
    printf("%.0f us per GEMV, %.1f GB/s of int4 weights (%.1f with the scales)\n", s * 1e6, n * (double)k / 2 / s / 1e9,
           (n * (double)k / 2 + 4.0 * n * groups) / s / 1e9);
  }
  return 0;
}
