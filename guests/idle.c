/*
 * idle: announces itself, then halts with interrupts off, forever.
 * Used to check that the VMM ends a guest that never exits (signals, and later
 * migration of an idle machine).
 */
#include "kit.h"

void guest_main(void)
{
	printf("idle: halting\n");
	for (;;) {
		cli();
		hlt();
	}
}
