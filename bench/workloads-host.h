/* The workloads of workloads.h as the host program calls them: compiled in their own
 * translation unit (workloads-host.c) with the guest's code-generation flags. */
#ifndef BENCH_WORKLOADS_HOST_H
#define BENCH_WORKLOADS_HOST_H
unsigned long hb_rdtsc(void);
unsigned long hb_intloop(unsigned long n, unsigned long seed);
void hb_memmove(void *dst, const void *src, unsigned long n);
unsigned long hb_touch(void *p, unsigned long n, unsigned long seed);
unsigned long hb_sum_pages(const void *p, unsigned long n);
#endif
