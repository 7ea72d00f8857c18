/*
 * kbd-cad: the i8042 keyboard delivers the operator's Ctrl+Alt+Del
 * (Firecracker's `SendCtrlAltDel` action) through IRQ 1, one byte per
 * interrupt, in the scancode set the controller's configuration byte asks
 * for.
 *
 * The guest writes the configuration byte (keyboard interrupt on, keyboard
 * enabled, translation as `xlate=` says: 1, the default, or 0), routes ISA
 * IRQ 1 (I/O APIC pin 1, edge) to itself, prints "kbd-cad: ready" and waits
 * up to `wait_s=` seconds (default 30) for the bytes.  Each interrupt reads
 * the status port, then one byte from port 0x60.  With translation the bytes
 * must be set 1 (1d 38 e0 53, then e0 d3 b8 9d), without it set 2 (14 11
 * e0 71, then e0 f0 71 f0 11 f0 14).  One interrupt per byte, none extra.
 */
#include "kit.h"

#define V_KBD		0x41
#define ISA_IRQ_KBD	1
#define KBD_DATA	0x60
#define KBD_STATUS	0x64
#define STATUS_OBF	0x01
#define CMD_WRITE_CTR	0x60
#define CTR_KBD_INT	0x01
#define CTR_SYS		0x04
#define CTR_XLATE	0x40
#define MAX_BYTES	32

static const u8 set1[] = {0x1d, 0x38, 0xe0, 0x53, 0xe0, 0xd3, 0xb8, 0x9d};
static const u8 set2[] = {0x14, 0x11, 0xe0, 0x71, 0xe0, 0xf0, 0x71, 0xf0, 0x11, 0xf0, 0x14};

static volatile u8 bytes[MAX_BYTES];
static volatile u32 interrupts, received, empty, stray;

static void handler(struct frame *f)
{
	if (f->vector != V_KBD) {
		stray++;
	} else {
		interrupts++;
		if (!(inb(KBD_STATUS) & STATUS_OBF))
			empty++;
		else if (received < MAX_BYTES)
			bytes[received++] = inb(KBD_DATA);
		else
			(void)inb(KBD_DATA);
	}
	lapic_eoi();
}

/* Waits with interrupts on until `want` bytes arrived or `us` passed. */
static void wait_bytes(u32 want, u64 us)
{
	u64 end = rdtsc() + us * (tsc_hz() / 1000000);
	sti();
	while (received < want && (s64)(rdtsc() - end) < 0)
		pause();
	cli();
}

void guest_main(void)
{
	bool xlate = cmdline_uint("xlate", 1) != 0;
	u64 wait_s = cmdline_uint("wait_s", 30);
	const u8 *want = xlate ? set1 : set2;
	u32 count = xlate ? sizeof(set1) : sizeof(set2);

	for (unsigned v = 0x20; v < 0xff; v++)
		set_handler(v, handler);
	lapic_enable();
	lapic_mask_lint0();
	pic_disable();
	ioapic_mask_all();
	tsc_hz();
	outb(KBD_STATUS, CMD_WRITE_CTR);
	outb(KBD_DATA, CTR_KBD_INT | CTR_SYS | (xlate ? CTR_XLATE : 0));
	if (inb(KBD_STATUS) & STATUS_OBF)
		fail("output buffer full before any key");
	ioapic_route(ISA_IRQ_KBD, V_KBD, (u8)lapic_id(), 0);
	printf("kbd-cad: ready (translation %s)\n", xlate ? "on" : "off");

	wait_bytes(count, wait_s * 1000000);
	wait_bytes(count + 1, 20000);	/* late extras */
	printf("kbd-cad: %u interrupts, %u bytes:", interrupts, received);
	for (u32 i = 0; i < received && i < MAX_BYTES; i++)
		printf(" %02x", bytes[i]);
	printf("\n");
	if (stray)
		fail("%u interrupts on other vectors", stray);
	if (empty)
		fail("%u keyboard interrupts with an empty output buffer", empty);
	if (received != count || interrupts != count)
		fail("expected %u bytes, one interrupt each", count);
	for (u32 i = 0; i < count; i++)
		if (bytes[i] != want[i])
			fail("byte %u is %02x, expected %02x", i, bytes[i], want[i]);
	printf("kbd-cad: Ctrl+Alt+Del make and break codes, scancode set %u\n", xlate ? 1 : 2);
	pass();
}
