/*
 * bootinfo: prints what the loader handed over (protocol, command line,
 * memory map, RSDP, vCPU count) and passes.  For checking a VMM's loaders.
 */
#include "kit.h"

void guest_main(void)
{
	printf("bootinfo: protocol=%s info=0x%lx rsdp=0x%lx\n",
	       boot_protocol_name(), boot_info_addr(), boot_rsdp_addr());
	printf("cmdline: %s\n", cmdline());
	printf("memmap: %d entries\n", memmap_count());
	for (int i = 0; i < memmap_count(); i++) {
		const struct mem_region *r = memmap_entry(i);
		printf("  addr=0x%016lx size=0x%016lx type=%u\n", r->addr, r->size, r->type);
	}
	printf("ram: %lu bytes\n", ram_bytes());
	printf("cpus: %u\n", cpu_count());
	pass();
}
