//! Conversions between KVM's structures and the backend-neutral ones.

use kvm_bindings::{
    kvm_dtable, kvm_fpu, kvm_lapic_state, kvm_mp_state, kvm_regs, kvm_segment, kvm_sregs,
    kvm_vcpu_events, KVM_MP_STATE_HALTED, KVM_MP_STATE_INIT_RECEIVED, KVM_MP_STATE_RUNNABLE,
    KVM_MP_STATE_SIPI_RECEIVED, KVM_MP_STATE_UNINITIALIZED, KVM_VCPUEVENT_VALID_NMI_PENDING,
    KVM_VCPUEVENT_VALID_SHADOW, KVM_VCPUEVENT_VALID_SIPI_VECTOR, KVM_VCPUEVENT_VALID_SMM,
};

use crate::{
    DescriptorTable, FpuState, LapicState, MpState, SegmentRegister, SpecialRegisters,
    StandardRegisters, VcpuEvents, LAPIC_REGS_SIZE,
};

pub fn regs_from_kvm(r: &kvm_regs) -> StandardRegisters {
    StandardRegisters {
        rax: r.rax,
        rbx: r.rbx,
        rcx: r.rcx,
        rdx: r.rdx,
        rsi: r.rsi,
        rdi: r.rdi,
        rsp: r.rsp,
        rbp: r.rbp,
        r8: r.r8,
        r9: r.r9,
        r10: r.r10,
        r11: r.r11,
        r12: r.r12,
        r13: r.r13,
        r14: r.r14,
        r15: r.r15,
        rip: r.rip,
        rflags: r.rflags,
    }
}

pub fn regs_to_kvm(r: &StandardRegisters) -> kvm_regs {
    kvm_regs {
        rax: r.rax,
        rbx: r.rbx,
        rcx: r.rcx,
        rdx: r.rdx,
        rsi: r.rsi,
        rdi: r.rdi,
        rsp: r.rsp,
        rbp: r.rbp,
        r8: r.r8,
        r9: r.r9,
        r10: r.r10,
        r11: r.r11,
        r12: r.r12,
        r13: r.r13,
        r14: r.r14,
        r15: r.r15,
        rip: r.rip,
        rflags: r.rflags,
    }
}

fn segment_from_kvm(s: &kvm_segment) -> SegmentRegister {
    SegmentRegister {
        base: s.base,
        limit: s.limit,
        selector: s.selector,
        type_: s.type_,
        present: s.present != 0,
        dpl: s.dpl,
        db: s.db != 0,
        s: s.s != 0,
        l: s.l != 0,
        g: s.g != 0,
        avl: s.avl != 0,
        unusable: s.unusable != 0,
    }
}

fn segment_to_kvm(s: &SegmentRegister) -> kvm_segment {
    kvm_segment {
        base: s.base,
        limit: s.limit,
        selector: s.selector,
        type_: s.type_,
        present: s.present.into(),
        dpl: s.dpl,
        db: s.db.into(),
        s: s.s.into(),
        l: s.l.into(),
        g: s.g.into(),
        avl: s.avl.into(),
        unusable: s.unusable.into(),
        padding: 0,
    }
}

fn dtable_from_kvm(d: &kvm_dtable) -> DescriptorTable {
    DescriptorTable {
        base: d.base,
        limit: d.limit,
    }
}

fn dtable_to_kvm(d: &DescriptorTable) -> kvm_dtable {
    kvm_dtable {
        base: d.base,
        limit: d.limit,
        ..Default::default()
    }
}

pub fn sregs_from_kvm(s: &kvm_sregs) -> SpecialRegisters {
    SpecialRegisters {
        cs: segment_from_kvm(&s.cs),
        ds: segment_from_kvm(&s.ds),
        es: segment_from_kvm(&s.es),
        fs: segment_from_kvm(&s.fs),
        gs: segment_from_kvm(&s.gs),
        ss: segment_from_kvm(&s.ss),
        tr: segment_from_kvm(&s.tr),
        ldt: segment_from_kvm(&s.ldt),
        gdt: dtable_from_kvm(&s.gdt),
        idt: dtable_from_kvm(&s.idt),
        cr0: s.cr0,
        cr2: s.cr2,
        cr3: s.cr3,
        cr4: s.cr4,
        cr8: s.cr8,
        efer: s.efer,
        apic_base: s.apic_base,
    }
}

/// Applies neutral special registers onto the kernel's current ones, so fields the neutral
/// form does not carry (the pending-interrupt bitmap) keep the kernel's values.
pub fn sregs_to_kvm(s: &SpecialRegisters, base: &kvm_sregs) -> kvm_sregs {
    kvm_sregs {
        cs: segment_to_kvm(&s.cs),
        ds: segment_to_kvm(&s.ds),
        es: segment_to_kvm(&s.es),
        fs: segment_to_kvm(&s.fs),
        gs: segment_to_kvm(&s.gs),
        ss: segment_to_kvm(&s.ss),
        tr: segment_to_kvm(&s.tr),
        ldt: segment_to_kvm(&s.ldt),
        gdt: dtable_to_kvm(&s.gdt),
        idt: dtable_to_kvm(&s.idt),
        cr0: s.cr0,
        cr2: s.cr2,
        cr3: s.cr3,
        cr4: s.cr4,
        cr8: s.cr8,
        efer: s.efer,
        apic_base: s.apic_base,
        interrupt_bitmap: base.interrupt_bitmap,
    }
}

pub fn fpu_from_kvm(f: &kvm_fpu) -> FpuState {
    FpuState {
        fpr: f.fpr,
        fcw: f.fcw,
        fsw: f.fsw,
        ftwx: f.ftwx,
        last_opcode: f.last_opcode,
        last_ip: f.last_ip,
        last_dp: f.last_dp,
        xmm: f.xmm,
        mxcsr: f.mxcsr,
    }
}

pub fn fpu_to_kvm(f: &FpuState) -> kvm_fpu {
    kvm_fpu {
        fpr: f.fpr,
        fcw: f.fcw,
        fsw: f.fsw,
        ftwx: f.ftwx,
        last_opcode: f.last_opcode,
        last_ip: f.last_ip,
        last_dp: f.last_dp,
        xmm: f.xmm,
        mxcsr: f.mxcsr,
        ..Default::default()
    }
}

pub fn lapic_from_kvm(l: &kvm_lapic_state) -> LapicState {
    LapicState {
        regs: l.regs.iter().map(|b| *b as u8).collect(),
    }
}

pub fn lapic_to_kvm(l: &LapicState) -> kvm_lapic_state {
    let mut state = kvm_lapic_state::default();
    for (dst, src) in state
        .regs
        .iter_mut()
        .zip(l.regs.iter().take(LAPIC_REGS_SIZE))
    {
        *dst = *src as _;
    }
    state
}

pub fn mp_state_from_kvm(m: kvm_mp_state) -> MpState {
    match m.mp_state {
        KVM_MP_STATE_UNINITIALIZED => MpState::Uninitialized,
        KVM_MP_STATE_INIT_RECEIVED => MpState::InitReceived,
        KVM_MP_STATE_HALTED => MpState::Halted,
        KVM_MP_STATE_SIPI_RECEIVED => MpState::SipiReceived,
        _ => MpState::Runnable,
    }
}

pub fn mp_state_to_kvm(m: MpState) -> kvm_mp_state {
    kvm_mp_state {
        mp_state: match m {
            MpState::Runnable => KVM_MP_STATE_RUNNABLE,
            MpState::Uninitialized => KVM_MP_STATE_UNINITIALIZED,
            MpState::InitReceived => KVM_MP_STATE_INIT_RECEIVED,
            MpState::Halted => KVM_MP_STATE_HALTED,
            MpState::SipiReceived => KVM_MP_STATE_SIPI_RECEIVED,
        },
    }
}

pub fn events_from_kvm(e: &kvm_vcpu_events) -> VcpuEvents {
    VcpuEvents {
        exception_injected: e.exception.injected != 0,
        exception_pending: e.exception.pending != 0,
        exception_nr: e.exception.nr,
        exception_has_error_code: e.exception.has_error_code != 0,
        exception_error_code: e.exception.error_code,
        interrupt_injected: e.interrupt.injected != 0,
        interrupt_nr: e.interrupt.nr,
        interrupt_soft: e.interrupt.soft != 0,
        interrupt_shadow: e.interrupt.shadow,
        nmi_injected: e.nmi.injected != 0,
        nmi_pending: e.nmi.pending != 0,
        nmi_masked: e.nmi.masked != 0,
        sipi_vector: e.sipi_vector,
        smi_pending: e.smi.pending != 0,
        smm: e.smi.smm != 0,
        latched_init: e.smi.latched_init != 0,
    }
}

pub fn events_to_kvm(e: &VcpuEvents) -> kvm_vcpu_events {
    let mut k = kvm_vcpu_events::default();
    k.exception.injected = e.exception_injected.into();
    k.exception.pending = e.exception_pending.into();
    k.exception.nr = e.exception_nr;
    k.exception.has_error_code = e.exception_has_error_code.into();
    k.exception.error_code = e.exception_error_code;
    k.interrupt.injected = e.interrupt_injected.into();
    k.interrupt.nr = e.interrupt_nr;
    k.interrupt.soft = e.interrupt_soft.into();
    k.interrupt.shadow = e.interrupt_shadow;
    k.nmi.injected = e.nmi_injected.into();
    k.nmi.pending = e.nmi_pending.into();
    k.nmi.masked = e.nmi_masked.into();
    k.sipi_vector = e.sipi_vector;
    k.smi.pending = e.smi_pending.into();
    k.smi.smm = e.smm.into();
    k.smi.latched_init = e.latched_init.into();
    k.flags = KVM_VCPUEVENT_VALID_NMI_PENDING
        | KVM_VCPUEVENT_VALID_SIPI_VECTOR
        | KVM_VCPUEVENT_VALID_SHADOW
        | KVM_VCPUEVENT_VALID_SMM;
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_round_trip_through_kvm() {
        let seg = SegmentRegister::from_descriptor(0x10, 0, 0xfffff, 0x9b, 0xc);
        assert_eq!(seg.limit, 0xffff_ffff);
        assert!(seg.db && seg.g && seg.present && seg.s && !seg.l);
        assert_eq!(segment_from_kvm(&segment_to_kvm(&seg)), seg);
    }

    #[test]
    fn events_round_trip_through_kvm() {
        let ev = VcpuEvents {
            exception_injected: true,
            exception_nr: 13,
            exception_has_error_code: true,
            exception_error_code: 0x18,
            nmi_masked: true,
            sipi_vector: 0x9,
            interrupt_shadow: 1,
            ..Default::default()
        };
        assert_eq!(events_from_kvm(&events_to_kvm(&ev)), ev);
    }

    #[test]
    fn mp_states_round_trip() {
        for m in [
            MpState::Runnable,
            MpState::Uninitialized,
            MpState::InitReceived,
            MpState::Halted,
            MpState::SipiReceived,
        ] {
            assert_eq!(mp_state_from_kvm(mp_state_to_kvm(m)), m);
        }
    }

    #[test]
    fn lapic_round_trips_and_tolerates_short_input() {
        let mut l = LapicState::default();
        l.write_u32(0x20, 3 << 24);
        l.write_u32(0x80, 0x20);
        assert_eq!(lapic_from_kvm(&lapic_to_kvm(&l)), l);
        let short = LapicState { regs: vec![1, 2] };
        assert_eq!(lapic_from_kvm(&lapic_to_kvm(&short)).regs[..3], [1, 2, 0]);
    }
}
