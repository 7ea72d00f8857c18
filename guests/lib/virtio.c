/*
 * virtio 1.x driver core over the modern PCI transport: capabilities,
 * status and feature negotiation, split virtqueues (optionally indirect
 * descriptors and event index), doorbells, completion by polling or MSI-X.
 * Meant to run at CPL 3 (native on PVM hosts); only interrupt handlers run
 * at CPL 0.
 */
#include "kit.h"

#define STATUS_POLL_US		2000	/* how often waits look for NEEDS_RESET */
#define MISSED_IRQ_US		1000000	/* a completion without interrupt after this is "missed" */
#define FERROVM_MEM32_BASE	0xc0000000ULL
#define FERROVM_MEM32_END	0xe0000000ULL
#define FERROVM_IO_BASE		0xc000u
#define FERROVM_IO_END		0x10000u

static inline void mb(void) { __asm__ volatile("mfence" ::: "memory"); }

/* ---- common configuration ---- */

static u8 rd8(struct virtio_dev *vd, u32 off) { return *(volatile u8 *)(vd->common + off); }
static u16 rd16(struct virtio_dev *vd, u32 off) { return *(volatile u16 *)(vd->common + off); }
static u32 rd32(struct virtio_dev *vd, u32 off) { return *(volatile u32 *)(vd->common + off); }
static void wr8(struct virtio_dev *vd, u32 off, u8 v) { *(volatile u8 *)(vd->common + off) = v; }
static void wr16(struct virtio_dev *vd, u32 off, u16 v) { *(volatile u16 *)(vd->common + off) = v; }
static void wr32(struct virtio_dev *vd, u32 off, u32 v) { *(volatile u32 *)(vd->common + off) = v; }

static void wr64(struct virtio_dev *vd, u32 off, u64 v)
{
	wr32(vd, off, (u32)v);
	wr32(vd, off + 4, (u32)(v >> 32));
}

u8 virtio_status(struct virtio_dev *vd) { return rd8(vd, VIRTIO_COMMON_STATUS); }
void virtio_set_status(struct virtio_dev *vd, u8 s) { wr8(vd, VIRTIO_COMMON_STATUS, s); }
u8 virtio_isr(struct virtio_dev *vd) { return *vd->isr; }

/* ---- discovery ---- */

u32 virtio_pci_type(const struct pci_dev *d)
{
	if (d->vendor != VIRTIO_PCI_VENDOR)
		return 0;
	if (d->device >= 0x1041 && d->device <= 0x107f)
		return d->device - 0x1040;
	if (d->device >= 0x1000 && d->device <= 0x103f)	/* transitional */
		return d->subsys_id;
	return 0;
}

struct pci_dev *virtio_find(u32 type, unsigned nth)
{
	for (int i = 0; i < pci_count(); i++) {
		struct pci_dev *d = pci_get(i);
		if (virtio_pci_type(d) == type && nth-- == 0)
			return d;
	}
	return NULL;
}

/* Maps one vendor capability; false if its window is not inside its BAR. */
static bool map_cap(struct pci_dev *pd, u8 cap, volatile u8 **ptr, u32 *len)
{
	u8 bar = pci_cfg_read8(pd->bdf, cap + 4);
	u32 off = pci_cfg_read32(pd->bdf, cap + 8);
	u32 length = pci_cfg_read32(pd->bdf, cap + 12);
	volatile void *p = pci_bar_ptr(pd, bar, off, length);
	if (!p) {
		bool unassigned = bar < 6 && pd->bar[bar].size && !pd->bar[bar].addr;
		printf("virtio: capability at 0x%x (type %u): BAR %u +0x%x len 0x%x not mapped "
		       "(BAR %s addr 0x%lx size 0x%lx)%s\n", cap, pci_cfg_read8(pd->bdf, cap + 3), bar,
		       off, length, bar < 6 ? pci_bar_kind_name(pd->bar[bar].kind) : "?",
		       bar < 6 ? pd->bar[bar].addr : 0, bar < 6 ? pd->bar[bar].size : 0,
		       unassigned ? ": unassigned, pci_assign=1 places BARs" : "");
		return false;
	}
	*ptr = p;
	*len = length;
	return true;
}

bool virtio_probe(struct virtio_dev *vd, struct pci_dev *pd)
{
	memset(vd, 0, sizeof(*vd));
	vd->pci = pd;
	vd->type = virtio_pci_type(pd);
	u32 common_len = 0, isr_len = 0;
	for (u8 cap = pci_find_cap(pd->bdf, PCI_CAP_ID_VNDR, 0); cap;
	     cap = pci_find_cap(pd->bdf, PCI_CAP_ID_VNDR, cap)) {
		u8 type = pci_cfg_read8(pd->bdf, cap + 3);
		u8 bar = pci_cfg_read8(pd->bdf, cap + 4);
		if (bar > 5)		/* reserved BAR values: ignore the capability */
			continue;
		if (type == VIRTIO_PCI_CAP_COMMON && !vd->common)
			map_cap(pd, cap, &vd->common, &common_len);
		else if (type == VIRTIO_PCI_CAP_ISR && !vd->isr)
			map_cap(pd, cap, &vd->isr, &isr_len);
		else if (type == VIRTIO_PCI_CAP_DEVICE && !vd->device_cfg)
			map_cap(pd, cap, &vd->device_cfg, &vd->device_cfg_len);
		else if (type == VIRTIO_PCI_CAP_NOTIFY && !vd->notify_base &&
			 map_cap(pd, cap, &vd->notify_base, &vd->notify_len))
			vd->notify_mult = pci_cfg_read32(pd->bdf, cap + 16);
	}
	if (!vd->common || common_len < 0x38 || !vd->notify_base || !vd->isr || !isr_len) {
		printf("virtio: %02x:%02x.%u lacks a usable common (len 0x%x), notify or ISR capability\n",
		       pd->bdf >> 8, (pd->bdf >> 3) & 31, pd->bdf & 7, common_len);
		return false;
	}
	pci_enable(pd, PCI_CMD_MEM | PCI_CMD_MASTER);
	vd->has_msix = msix_probe(&vd->msix, pd);
	return true;
}

void pci_assign_unassigned(void)
{
	for (int i = 0; i < pci_count(); i++) {
		struct pci_dev *d = pci_get(i);
		int n = pci_assign_bars(d, FERROVM_MEM32_BASE, FERROVM_MEM32_END, FERROVM_IO_BASE,
					FERROVM_IO_END);
		if (n < 0)
			printf("pci: %04x:%04x: a BAR does not fit the windows\n", d->vendor, d->device);
		else if (n > 0)
			printf("pci: %04x:%04x: assigned %d BAR(s)\n", d->vendor, d->device, n);
	}
}

static void print_device(struct virtio_dev *vd)
{
	struct pci_dev *pd = vd->pci;
	printf("virtio: type %u at 00:%02x.%u (%04x:%04x), config via %s", vd->type,
	       (pd->bdf >> 3) & 31, pd->bdf & 7, pd->vendor, pd->device,
	       pci_mech() == PCI_MECH_ECAM ? "ECAM" : "CF8");
	if (pci_mech() == PCI_MECH_ECAM)
		printf(" at 0x%lx", pci_ecam_base());
	for (int b = 0; b < 6; b++)
		if (pd->bar[b].size)
			printf(", BAR%d %s 0x%lx+0x%lx", b, pci_bar_kind_name(pd->bar[b].kind),
			       pd->bar[b].addr, pd->bar[b].size);
	if (vd->has_msix)
		printf(", MSI-X %u entries", vd->msix.entries);
	printf("\n");
}

bool virtio_open(struct virtio_dev *vd, u32 type, unsigned nth)
{
	size_t len;
	const char *p = cmdline_arg("pci", &len);
	bool cf8 = p && len == 3 && !strncmp(p, "cf8", 3);
	pci_init(cf8 ? PCI_MECH_CF8 : PCI_MECH_ECAM);
	const char *w = cmdline_arg("wait", &len);
	if (w && len == 3 && !strncmp(w, "hlt", 3))
		virtio_wait_halt(true);
	pci_scan();
	if (cmdline_uint("pci_assign", 0))
		pci_assign_unassigned();
	struct pci_dev *pd = virtio_find(type, nth);
	if (!pd) {
		printf("virtio: no device of type %u (#%u) among %d PCI functions (RSDP 0x%lx, "
		       "ECAM 0x%lx, config via %s)\n", type, nth, pci_count(), acpi_rsdp(),
		       pci_ecam_base(), pci_mech() == PCI_MECH_ECAM ? "ECAM" : "CF8");
		return false;
	}
	if (!virtio_probe(vd, pd))
		return false;
	print_device(vd);
	return true;
}

/* ---- status, features ---- */

bool virtio_reset(struct virtio_dev *vd)
{
	virtio_set_status(vd, 0);
	struct timeout t;
	timeout_start(&t, 1000000);
	while (virtio_status(vd) != 0) {
		if (timeout_expired(&t)) {
			printf("virtio: device status still 0x%x 1 s after reset\n", virtio_status(vd));
			return false;
		}
		pause();
	}
	memset(vd->vq, 0, sizeof(vd->vq));
	vd->features = 0;
	return true;
}

bool virtio_init(struct virtio_dev *vd, u64 wanted)
{
	if (!virtio_reset(vd))
		return false;
	virtio_set_status(vd, VIRTIO_S_ACKNOWLEDGE);
	virtio_set_status(vd, VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER);
	wr32(vd, VIRTIO_COMMON_DFSELECT, 0);
	u64 lo = rd32(vd, VIRTIO_COMMON_DF);
	wr32(vd, VIRTIO_COMMON_DFSELECT, 1);
	u64 hi = rd32(vd, VIRTIO_COMMON_DF);
	vd->device_features = lo | hi << 32;
	u64 f = vd->device_features & (wanted | VIRTIO_BIT(VIRTIO_F_VERSION_1));
	if (!(f & VIRTIO_BIT(VIRTIO_F_VERSION_1))) {
		printf("virtio: device does not offer VERSION_1 (features 0x%lx)\n", vd->device_features);
		virtio_set_status(vd, VIRTIO_S_FAILED);
		return false;
	}
	wr32(vd, VIRTIO_COMMON_GFSELECT, 0);
	wr32(vd, VIRTIO_COMMON_GF, (u32)f);
	wr32(vd, VIRTIO_COMMON_GFSELECT, 1);
	wr32(vd, VIRTIO_COMMON_GF, (u32)(f >> 32));
	u8 s = VIRTIO_S_ACKNOWLEDGE | VIRTIO_S_DRIVER | VIRTIO_S_FEATURES_OK;
	virtio_set_status(vd, s);
	if (!(virtio_status(vd) & VIRTIO_S_FEATURES_OK)) {
		printf("virtio: device refused features 0x%lx (status 0x%x)\n", f, virtio_status(vd));
		virtio_set_status(vd, s | VIRTIO_S_FAILED);
		return false;
	}
	vd->features = f;
	vd->num_queues = rd16(vd, VIRTIO_COMMON_NUMQ);
	return true;
}

void virtio_driver_ok(struct virtio_dev *vd)
{
	virtio_set_status(vd, virtio_status(vd) | VIRTIO_S_DRIVER_OK);
}

/* ---- device configuration ---- */

static bool cfg_ok(struct virtio_dev *vd, u32 off, u32 n)
{
	return vd->device_cfg && off + n <= vd->device_cfg_len;
}

u8 virtio_cfg_read8(struct virtio_dev *vd, u32 off)
{
	return cfg_ok(vd, off, 1) ? vd->device_cfg[off] : 0xff;
}

u16 virtio_cfg_read16(struct virtio_dev *vd, u32 off)
{
	return cfg_ok(vd, off, 2) ? *(volatile u16 *)(vd->device_cfg + off) : 0xffff;
}

u32 virtio_cfg_read32(struct virtio_dev *vd, u32 off)
{
	return cfg_ok(vd, off, 4) ? *(volatile u32 *)(vd->device_cfg + off) : ~0u;
}

u64 virtio_cfg_read64(struct virtio_dev *vd, u32 off)
{
	if (!cfg_ok(vd, off, 8))
		return ~0ULL;
	for (int tries = 0; tries < 100; tries++) {
		u8 gen = rd8(vd, VIRTIO_COMMON_CFGGEN);
		u64 lo = *(volatile u32 *)(vd->device_cfg + off);
		u64 hi = *(volatile u32 *)(vd->device_cfg + off + 4);
		if (rd8(vd, VIRTIO_COMMON_CFGGEN) == gen)
			return lo | hi << 32;
	}
	fail("virtio: config_generation never stable");
}

void virtio_cfg_write8(struct virtio_dev *vd, u32 off, u8 v)
{
	if (cfg_ok(vd, off, 1))
		vd->device_cfg[off] = v;
}

/* ---- MSI-X ---- */

static struct {
	struct virtq *q;
	struct virtio_dev *vd;
} irq_owner[256];

static void virtio_irq(struct frame *f)
{
	unsigned v = f->vector & 255;
	if (irq_owner[v].q)
		atomic_inc(&irq_owner[v].q->irqs);
	else if (irq_owner[v].vd)
		atomic_inc(&irq_owner[v].vd->config_irqs);
	lapic_eoi();
}

static u64 install_handler(u64 vector)
{
	set_handler((unsigned)vector, virtio_irq);
	return 0;
}

void virtq_bind_irq(struct virtq *q, u8 vector)
{
	irq_owner[vector].q = q;
	irq_owner[vector].vd = NULL;
	q->vector = vector;
	ring0_call(install_handler, vector);
}

void virtio_bind_config_irq(struct virtio_dev *vd, u8 vector)
{
	irq_owner[vector].q = NULL;
	irq_owner[vector].vd = vd;
	ring0_call(install_handler, vector);
}

bool virtio_msix_enable(struct virtio_dev *vd, u16 config_entry)
{
	if (!vd->has_msix)
		return false;
	for (unsigned i = 0; i < vd->msix.entries; i++)
		msix_mask(&vd->msix, i, true);
	msix_function_mask(&vd->msix, false);
	msix_enable(&vd->msix, true);
	vd->msix_on = true;
	wr16(vd, VIRTIO_COMMON_MSIX, config_entry);
	if (rd16(vd, VIRTIO_COMMON_MSIX) != config_entry) {
		printf("virtio: device refused MSI-X entry %u for configuration changes\n", config_entry);
		return false;
	}
	return true;
}

void virtio_msix_route(struct virtio_dev *vd, u16 entry, u32 apic_id, u8 vector)
{
	msix_set(&vd->msix, entry, apic_id, vector, false);
}

/* ---- virtqueues ---- */

/* A queue's rings and bookkeeping, in the DMA pool; every descriptor free. */
static struct virtq *alloc_queue(struct virtio_dev *vd, u16 index, u16 size)
{
	struct virtq *q = dma_alloc(sizeof(*q), 64);
	q->vdev = vd;
	q->index = index;
	q->size = size;
	q->desc = dma_alloc(16UL * size, 4096);
	q->avail = dma_alloc(6 + 2UL * size, 4096);
	q->used = dma_alloc(6 + 8UL * size, 4096);
	q->tokens = dma_alloc(sizeof(void *) * size, 8);
	q->chain_len = dma_alloc(2UL * size, 8);
	q->event_idx = virtio_has(vd, VIRTIO_F_EVENT_IDX);
	q->indirect = q->use_indirect = virtio_has(vd, VIRTIO_F_INDIRECT_DESC);
	if (q->indirect)
		q->itables = dma_alloc(16UL * VIRTQ_INDIRECT_MAX * size, 4096);
	for (u16 i = 0; i < size; i++)
		q->desc[i].next = (u16)(i + 1);
	q->num_free = size;
	return q;
}

struct virtq *virtio_queue_setup(struct virtio_dev *vd, u16 index, u16 size, u16 msix_entry)
{
	if (index >= VIRTIO_MAX_QUEUES || index >= vd->num_queues) {
		printf("virtio: queue %u: the device has %u queues\n", index, vd->num_queues);
		return NULL;
	}
	wr16(vd, VIRTIO_COMMON_Q_SELECT, index);
	u16 max = rd16(vd, VIRTIO_COMMON_Q_SIZE);
	if (max == 0) {
		printf("virtio: queue %u is not available (size 0)\n", index);
		return NULL;
	}
	if (size == 0 || size > max)
		size = max;
	while (size & (size - 1))	/* split rings: a power of two */
		size &= size - 1;
	struct virtq *q = alloc_queue(vd, index, size);
	q->msix_entry = msix_entry;
	wr16(vd, VIRTIO_COMMON_Q_SIZE, size);
	wr64(vd, VIRTIO_COMMON_Q_DESC, (u64)q->desc);
	wr64(vd, VIRTIO_COMMON_Q_AVAIL, (u64)q->avail);
	wr64(vd, VIRTIO_COMMON_Q_USED, (u64)q->used);
	wr16(vd, VIRTIO_COMMON_Q_MSIX, msix_entry);
	u16 got = rd16(vd, VIRTIO_COMMON_Q_MSIX);
	if (got != msix_entry) {
		printf("virtio: queue %u: device refused MSI-X entry %u (reads %u)\n", index,
		       msix_entry, got);
		return NULL;
	}
	u32 noff = (u32)rd16(vd, VIRTIO_COMMON_Q_NOFF) * vd->notify_mult;
	if ((u64)noff + 2 > vd->notify_len) {
		printf("virtio: queue %u: doorbell at +0x%x outside the notify window (0x%x)\n",
		       index, noff, vd->notify_len);
		return NULL;
	}
	q->notify = (volatile u16 *)(vd->notify_base + noff);
	wr16(vd, VIRTIO_COMMON_Q_ENABLE, 1);
	vd->vq[index] = q;
	return q;
}

void virtq_use_indirect(struct virtq *q, bool on)
{
	q->use_indirect = on && q->indirect;
}

static u16 desc_flags(unsigned i, unsigned n_out, unsigned n)
{
	return (i >= n_out ? VIRTQ_DESC_F_WRITE : 0) | (i + 1 < n ? VIRTQ_DESC_F_NEXT : 0);
}

static void publish(struct virtq *q, u16 head)
{
	q->avail->ring[q->avail_idx % q->size] = head;
	barrier();			/* x86 keeps stores in order; the compiler must too */
	q->avail_idx++;
	q->avail->idx = q->avail_idx;
}

int virtq_add(struct virtq *q, const struct vbuf *bufs, unsigned n_out, unsigned n_in, void *token)
{
	unsigned n = n_out + n_in;
	bool ind = q->use_indirect && n > 1 && n <= VIRTQ_INDIRECT_MAX;
	unsigned need = ind ? 1 : n;
	if (n == 0 || !token || q->num_free < need)
		return -1;
	u16 head = q->free_head;
	if (ind) {
		struct virtq_desc *t = &q->itables[(u32)head * VIRTQ_INDIRECT_MAX];
		for (unsigned i = 0; i < n; i++)
			t[i] = (struct virtq_desc){ (u64)bufs[i].addr, bufs[i].len,
						    desc_flags(i, n_out, n), (u16)(i + 1) };
		q->desc[head].addr = (u64)t;
		q->desc[head].len = 16 * n;
		q->desc[head].flags = VIRTQ_DESC_F_INDIRECT;
		q->free_head = q->desc[head].next;
	} else {
		u16 i = head;
		for (unsigned k = 0; k < n; k++) {
			q->desc[i].addr = (u64)bufs[k].addr;
			q->desc[i].len = bufs[k].len;
			q->desc[i].flags = desc_flags(k, n_out, n);
			i = q->desc[i].next;	/* the free list links the chain already */
		}
		q->free_head = i;
	}
	q->num_free -= need;
	q->tokens[head] = token;
	q->chain_len[head] = (u16)need;
	publish(q, head);
	return head;
}

void virtq_notify(struct virtq *q)
{
	*q->notify = q->index;
	q->kicks++;
}

/* The u16 after the used ring's elements. */
static volatile u16 *avail_event(struct virtq *q)
{
	return (volatile u16 *)((volatile u8 *)q->used + 4 + 8UL * q->size);
}

bool virtq_kick(struct virtq *q)
{
	mb();			/* avail->idx visible before reading the device's wishes */
	u16 old = q->kicked_idx, now = q->avail_idx;
	if (old == now)
		return false;
	q->kicked_idx = now;
	bool need;
	if (q->event_idx) {
		u16 ev = *avail_event(q);
		need = (u16)(now - ev - 1) < (u16)(now - old);
	} else {
		need = !(q->used->flags & VIRTQ_USED_F_NO_NOTIFY);
	}
	if (need)
		virtq_notify(q);
	return need;
}

bool virtq_has_used(struct virtq *q)
{
	return q->used->idx != q->last_used;
}

void *virtq_get(struct virtq *q, u32 *len)
{
	if (!virtq_has_used(q))
		return NULL;
	barrier();		/* the element after the index (loads stay in order on x86) */
	volatile struct virtq_used_elem *ue = &q->used->ring[q->last_used % q->size];
	struct virtq_used_elem e = { ue->id, ue->len };
	if (e.id >= q->size || !q->tokens[e.id])
		fail("virtq %u: used element %u names descriptor %u, not a chain in flight",
		     q->index, q->last_used, e.id);
	void *token = q->tokens[e.id];
	q->tokens[e.id] = NULL;
	u16 tail = (u16)e.id;
	for (u16 k = 1; k < q->chain_len[e.id]; k++)
		tail = q->desc[tail].next;
	q->desc[tail].next = q->free_head;
	q->free_head = (u16)e.id;
	q->num_free += q->chain_len[e.id];
	q->last_used++;
	q->completions++;
	if (len)
		*len = e.len;
	return token;
}

void virtq_irq_enable(struct virtq *q, bool on)
{
	if (q->event_idx) {
		volatile u16 *used_event = &q->avail->ring[q->size];
		*used_event = on ? q->last_used : (u16)(q->last_used - 1);
	} else {
		q->avail->flags = on ? 0 : VIRTQ_AVAIL_F_NO_INTERRUPT;
	}
}

static bool irq_driven(struct virtq *q)
{
	return q->msix_entry != VIRTIO_MSI_NO_VECTOR && q->vector && q->vdev->msix_on;
}

/* Looks at the device status every STATUS_POLL_US: true if NEEDS_RESET. */
static bool needs_reset(struct virtq *q, u64 *next_check)
{
	u64 now = rdtsc();
	if ((s64)(now - *next_check) < 0)
		return false;
	*next_check = now + STATUS_POLL_US * (tsc_hz() / 1000000);
	return virtio_status(q->vdev) & VIRTIO_S_NEEDS_RESET;
}

/* ---- halting waits ---- */

#define WAKE_VECTOR	0xef		/* LAPIC one-shot that bounds a halt */
#define WAKE_COUNT	2000000u	/* ~2 ms at KVM's 1 GHz LAPIC timer clock */

static bool halt_waits;

static void wake_handler(struct frame *f)
{
	(void)f;
	lapic_eoi();
}

static u64 install_wake(u64 unused)
{
	(void)unused;
	set_handler(WAKE_VECTOR, wake_handler);
	return 0;
}

void virtio_wait_halt(bool on)
{
	if (on && !halt_waits)
		ring0_call(install_wake, 0);
	halt_waits = on;
}

/* Ring 0, interrupts off: halts until an interrupt (at most ~2 ms) unless the
 * queue's interrupt already came. */
static u64 halt_for_irq(u64 qp)
{
	struct virtq *q = (struct virtq *)qp;
	if (q->irqs != q->irqs_seen)
		return 0;
	lapic_timer_oneshot(WAKE_VECTOR, WAKE_COUNT, LAPIC_DIV_1);
	__asm__ volatile("sti; hlt; cli" ::: "memory");
	return 0;
}

int virtq_wait(struct virtq *q, u64 timeout_us)
{
	struct timeout t, missed;
	u64 next_check = rdtsc();
	timeout_start(&t, timeout_us);
	if (!irq_driven(q)) {
		while (!virtq_has_used(q)) {
			if (needs_reset(q, &next_check))
				return -1;
			if (timeout_expired(&t))
				return 0;
			pause();
		}
		return 1;
	}
	for (;;) {
		if (virtq_has_used(q))
			return 1;
		virtq_irq_enable(q, true);
		mb();		/* used_event / flags written before looking again */
		if (virtq_has_used(q))
			return 1;
		timeout_start(&missed, MISSED_IRQ_US);
		bool seen_used = false;
		while (q->irqs == q->irqs_seen) {
			if (needs_reset(q, &next_check))
				return -1;
			if (virtq_has_used(q)) {
				if (!seen_used)
					timeout_start(&missed, MISSED_IRQ_US);
				seen_used = true;
				if (timeout_expired(&missed)) {
					q->missed_irqs++;
					return 1;
				}
			}
			if (timeout_expired(&t))
				return 0;
			if (halt_waits)
				ring0_call(halt_for_irq, (u64)q);
			else
				pause();
		}
		q->irqs_seen = q->irqs;
		q->waits_irq++;
	}
}

void virtq_publish_raw(struct virtq *q, u16 head)
{
	publish(q, head);
}

bool virtq_get_raw(struct virtq *q, struct virtq_used_elem *e)
{
	if (!virtq_has_used(q))
		return false;
	barrier();
	volatile struct virtq_used_elem *ue = &q->used->ring[q->last_used % q->size];
	*e = (struct virtq_used_elem){ ue->id, ue->len };
	q->last_used++;
	return true;
}

int virtq_sync(struct virtq *q, const struct vbuf *bufs, unsigned n_out, unsigned n_in, u32 *len,
	       u64 timeout_us)
{
	static u8 token;
	if (virtq_add(q, bufs, n_out, n_in, &token) < 0)
		fail("virtq %u: no room for a %u-buffer chain", q->index, n_out + n_in);
	virtq_kick(q);
	int w = virtq_wait(q, timeout_us);
	if (w <= 0)
		return w;
	void *t = virtq_get(q, len);
	if (t != &token)
		fail("virtq %u: an unexpected chain completed", q->index);
	return 1;
}
