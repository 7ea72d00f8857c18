/* Thin wrappers around x86 instructions. */
#ifndef KIT_X86_H
#define KIT_X86_H

#include <stdint.h>

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef int8_t s8;
typedef int16_t s16;
typedef int32_t s32;
typedef int64_t s64;

static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" :: "a"(v), "Nd"(port)); }
static inline void outw(u16 port, u16 v) { __asm__ volatile("outw %0, %1" :: "a"(v), "Nd"(port)); }
static inline void outl(u16 port, u32 v) { __asm__ volatile("outl %0, %1" :: "a"(v), "Nd"(port)); }
static inline u8 inb(u16 port) { u8 v; __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u16 inw(u16 port) { u16 v; __asm__ volatile("inw %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u32 inl(u16 port) { u32 v; __asm__ volatile("inl %1, %0" : "=a"(v) : "Nd"(port)); return v; }

struct cpuid_regs { u32 eax, ebx, ecx, edx; };

static inline struct cpuid_regs cpuid(u32 leaf, u32 subleaf)
{
	struct cpuid_regs r;
	__asm__ volatile("cpuid" : "=a"(r.eax), "=b"(r.ebx), "=c"(r.ecx), "=d"(r.edx)
			 : "a"(leaf), "c"(subleaf));
	return r;
}

static inline u64 rdmsr(u32 msr)
{
	u32 lo, hi;
	__asm__ volatile("rdmsr" : "=a"(lo), "=d"(hi) : "c"(msr));
	return ((u64)hi << 32) | lo;
}

static inline void wrmsr(u32 msr, u64 v)
{
	__asm__ volatile("wrmsr" :: "c"(msr), "a"((u32)v), "d"((u32)(v >> 32)) : "memory");
}

static inline u64 rdtsc(void)
{
	u32 lo, hi;
	__asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
	return ((u64)hi << 32) | lo;
}

static inline void cli(void) { __asm__ volatile("cli" ::: "memory"); }
static inline void sti(void) { __asm__ volatile("sti" ::: "memory"); }
static inline void hlt(void) { __asm__ volatile("hlt" ::: "memory"); }
static inline void pause(void) { __asm__ volatile("pause" ::: "memory"); }
static inline void barrier(void) { __asm__ volatile("" ::: "memory"); }

static inline u64 read_rflags(void)
{
	u64 f;
	__asm__ volatile("pushfq; popq %0" : "=r"(f));
	return f;
}

static inline u16 read_cs(void)
{
	u16 cs;
	__asm__ volatile("movw %%cs, %0" : "=r"(cs));
	return cs;
}

/* Current privilege level (0 or 3). */
static inline unsigned cpl(void) { return read_cs() & 3; }

#define DEFINE_CR(n)								\
	static inline u64 read_cr##n(void)					\
	{ u64 v; __asm__ volatile("mov %%cr" #n ", %0" : "=r"(v)); return v; } \
	static inline void write_cr##n(u64 v)					\
	{ __asm__ volatile("mov %0, %%cr" #n :: "r"(v) : "memory"); }
DEFINE_CR(0)
DEFINE_CR(2)
DEFINE_CR(3)
DEFINE_CR(4)
#undef DEFINE_CR

#endif
