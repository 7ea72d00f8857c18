/*
 * triple-fault: loads an empty IDT and executes UD2. #UD cannot be delivered,
 * nor can the #GP and #DF that follow: the CPU shuts down. The VMM must report
 * a triple fault with the RIP and exit with status 2.
 */
#include "kit.h"

void guest_main(void)
{
	struct {
		u16 limit;
		u64 base;
	} __attribute__((packed)) empty = { 0, 0 };

	printf("triple-fault: loading an empty IDT\n");
	__asm__ volatile("lidt %0\n\tud2" :: "m"(empty) : "memory");
	fail("still running after a triple fault");
}
