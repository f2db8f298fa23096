// What a fresh page costs in this VM: 8 MiB of anonymous memory touched a
// page at a time (4 KiB pages), the same with MAP_POPULATE, and the same on
// 2 MiB transparent huge pages (MADV_HUGEPAGE). Three rounds each.
//
//     cc -O2 -o /tmp/page_faults bench/programs/page_faults.c && /tmp/page_faults
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static double touch(char *p, size_t n) {
    double t = now_ms();
    for (size_t i = 0; i < n; i += 4096) p[i] = 1;
    return now_ms() - t;
}

int main(void) {
    const size_t n = 8 << 20, huge = 2 << 20;
    for (int round = 0; round < 3; round++) {
        char *p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        double small = touch(p, n);
        munmap(p, n);
        double t = now_ms();
        p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        touch(p, n);
        double populated = now_ms() - t;
        munmap(p, n);
        char *raw = mmap(0, n + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        char *aligned = (char *)(((uintptr_t)raw + huge - 1) & ~(uintptr_t)(huge - 1));
        madvise(aligned, n, MADV_HUGEPAGE);
        double on_huge = touch(aligned, n);
        munmap(raw, n + huge);
        printf("8 MiB: 4 KiB pages %.1f ms (%.1f us a page), MAP_POPULATE %.1f ms, huge pages %.2f ms (%.2f ms a 2 MiB page)\n",
               small, small * 1000 / (n / 4096), populated, on_huge, on_huge / (n / huge));
    }
    return 0;
}
