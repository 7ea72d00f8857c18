/*
 * fault: takes a deliberate #GP (a load from a non-canonical address).
 * Expected: the library reports "EXCEPTION #GP vector=13 ..." at the
 * announced rip and exits with code 0x7e (VMM status 253).
 */
#include "kit.h"

extern char fault_rip[];
void noncanonical_load(void);

__asm__(".text\n"
	".globl noncanonical_load\n"
	"noncanonical_load:\n"
	"	movabsq $0x8000000000000000, %rax\n"
	".globl fault_rip\n"
	"fault_rip:\n"
	"	movq (%rax), %rax\n"
	"	ret\n");

void guest_main(void)
{
	printf("fault: expecting #GP at rip=0x%lx\n", (u64)fault_rip);
	noncanonical_load();
	fail("no #GP from a non-canonical load");
}
