/* TSS descriptor, IDT, trap dispatch and ring-3 services. */
#include "kit.h"

extern u8 gdt_tss_desc[16];
extern u8 tss[], tss_end[];
extern u8 isr_stubs[];
NORETURN void ring3_resume(u64 value);

void cpu_init(void);
void trap_dispatch(struct frame *f);

struct idt_gate {
	u16 off_lo;
	u16 sel;
	u8 ist;
	u8 type;		/* P | DPL | type */
	u16 off_mid;
	u32 off_hi;
	u32 zero;
} __attribute__((packed));

static struct idt_gate idt[256] __attribute__((aligned(16)));
static trap_handler_t handlers[256];

static void set_gate(unsigned vec, unsigned ist)
{
	u64 a = (u64)isr_stubs + 16 * vec;
	idt[vec] = (struct idt_gate){
		.off_lo = (u16)a,
		.sel = KCODE64,
		.ist = (u8)ist,
		.type = 0x8e,	/* present, DPL 0, 64-bit interrupt gate */
		.off_mid = (u16)(a >> 16),
		.off_hi = (u32)(a >> 32),
	};
}

void cpu_init(void)
{
	/* 64-bit available TSS descriptor (the only field not static). */
	u64 base = (u64)tss, limit = (u64)(tss_end - tss) - 1;
	u64 lo = (limit & 0xffff) | (base & 0xffffff) << 16 | (u64)0x89 << 40 |
		 ((limit >> 16) & 0xf) << 48 | ((base >> 24) & 0xff) << 56;
	u64 hi = base >> 32;
	memcpy(gdt_tss_desc, &lo, 8);
	memcpy(gdt_tss_desc + 8, &hi, 8);
	__asm__ volatile("ltr %w0" :: "r"(TSS_SEL));

	/* Exceptions only: 32 gates.  Vectors 32-255 get theirs from set_handler(). */
	for (unsigned v = 0; v < 32; v++)
		set_gate(v, (v == 2 || v == 8 || v == 18) ? 1 : 0);
	struct {
		u16 limit;
		u64 base;
	} __attribute__((packed)) idtr = { sizeof(idt) - 1, (u64)idt };
	__asm__ volatile("lidt %0" :: "m"(idtr));
}

void set_handler(unsigned vector, trap_handler_t h)
{
	if (vector > 255)
		return;
	handlers[vector] = h;
	if (vector >= 32 && h)
		set_gate(vector, 0);
}

static const char *const names[32] = {
	"#DE", "#DB", "NMI", "#BP", "#OF", "#BR", "#UD", "#NM",
	"#DF", "CSO", "#TS", "#NP", "#SS", "#GP", "#PF", "RSV15",
	"#MF", "#AC", "#MC", "#XM", "#VE", "#CP", "RSV22", "RSV23",
	"RSV24", "RSV25", "RSV26", "RSV27", "#HV", "#VC", "#SX", "RSV31",
};

const char *exception_name(unsigned vector)
{
	return vector < 32 ? names[vector] : "IRQ";
}

NORETURN void fatal_trap(struct frame *f)
{
	static int depth;
	if (depth++)	/* fault while reporting: just leave */
		exit_vm(EXIT_EXCEPTION);
	const char *name = exception_name((unsigned)f->vector);
	printf("EXCEPTION %s vector=%lu error=0x%lx rip=0x%lx\n", name, f->vector, f->error, f->rip);
	printf("  cs=0x%lx rflags=0x%lx rsp=0x%lx ss=0x%lx", f->cs, f->rflags, f->rsp, f->ss);
	if (f->vector == 14)
		printf(" cr2=0x%lx", read_cr2());
	printf("\n");
	if (f->vector == 6 && (f->cs & 3) == 3 && f->rip < (4ull << 30) - 1 &&
	    *(const u8 *)f->rip == 0xcd)
		printf("  (INT n at CPL 3 arrives as #UD on PVM hosts: use ring3_service())\n");
	fail_code(EXIT_EXCEPTION, "exception %s (vector %lu) at rip=0x%lx", name, f->vector, f->rip);
}

/* A UD2 at CPL 3 with a known service number in RAX.  Returns false if it
 * is not a service request (a real #UD). */
static bool ring3_service_request(struct frame *f)
{
	const u8 *ip = (const u8 *)f->rip;
	if (f->rip >= (4ull << 30) - 1 || ip[0] != 0x0f || ip[1] != 0x0b)	/* not UD2 */
		return false;
	switch (f->rax) {
	case SVC_RING3_EXIT:
		ring3_resume(f->rdi);
	case SVC_CALL:
		f->rax = ((u64 (*)(u64))f->rdi)(f->rsi);
		break;
	case SVC_EXIT_VM:
		exit_vm((u8)f->rdi);
	case SVC_NOP:
		f->rax = 0;
		break;
	default:
		return false;
	}
	f->rip += 2;
	return true;
}

void trap_dispatch(struct frame *f)
{
	if (f->vector == 6 && (f->cs & 3) == 3 && ring3_service_request(f))
		return;
	trap_handler_t h = handlers[f->vector & 255];
	if (h) {
		h(f);
		return;
	}
	fatal_trap(f);
}

u64 ring0_call(u64 (*fn)(u64), u64 arg)
{
	if (cpl() == 0)
		return fn(arg);
	return ring3_service(SVC_CALL, (u64)fn, arg);
}
