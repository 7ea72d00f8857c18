/* workloads.h for the host program, built with the same code-generation flags as the
 * guests (bench/Makefile: WL_CFLAGS), so host and guest run the same loops. */
#include "workloads.h"
#include "workloads-host.h"

unsigned long hb_rdtsc(void) { return wl_rdtsc(); }
unsigned long hb_intloop(unsigned long n, unsigned long seed) { return wl_intloop(n, seed); }
void hb_memmove(void *dst, const void *src, unsigned long n) { wl_memmove(dst, src, n); }
unsigned long hb_touch(void *p, unsigned long n, unsigned long seed) { return wl_touch(p, n, seed); }
unsigned long hb_sum_pages(const void *p, unsigned long n) { return wl_sum_pages(p, n); }
