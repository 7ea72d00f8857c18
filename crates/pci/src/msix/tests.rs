use std::sync::Mutex;

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Update(u16, Option<MsiMessage>),
    Fire(u16),
}

#[derive(Default)]
struct Recorder(Mutex<Vec<Event>>);

impl Recorder {
    fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl MsiTarget for Recorder {
    fn update(&self, vector: u16, message: Option<MsiMessage>) {
        self.0.lock().unwrap().push(Event::Update(vector, message));
    }
    fn fire(&self, vector: u16) {
        self.0.lock().unwrap().push(Event::Fire(vector));
    }
}

const LOCATION: MsixLocation = MsixLocation {
    table_bar: 0,
    table_offset: 0x4000,
    pba_bar: 0,
    pba_offset: 0x5000,
};

fn msix(size: u16) -> (Msix, Arc<Recorder>) {
    let rec = Arc::new(Recorder::default());
    (Msix::new(size, LOCATION, rec.clone()).unwrap(), rec)
}

fn program(m: &mut Msix, vector: u16, address: u64, data: u32) {
    let base = u64::from(vector) * ENTRY_SIZE;
    m.write_table(base, &address.to_le_bytes());
    m.write_table(base + 8, &data.to_le_bytes());
}

fn unmask(m: &mut Msix, vector: u16) {
    m.write_table(u64::from(vector) * ENTRY_SIZE + 12, &0u32.to_le_bytes());
}

fn mask(m: &mut Msix, vector: u16) {
    m.write_table(u64::from(vector) * ENTRY_SIZE + 12, &1u32.to_le_bytes());
}

fn msg(address: u64, data: u32) -> Option<MsiMessage> {
    Some(MsiMessage { address, data })
}

#[test]
fn construction_checks() {
    let rec: Arc<dyn MsiTarget> = Arc::new(Recorder::default());
    assert_eq!(
        Msix::new(0, LOCATION, rec.clone()).unwrap_err(),
        MsixError::TableSize(0)
    );
    assert_eq!(
        Msix::new(2049, LOCATION, rec.clone()).unwrap_err(),
        MsixError::TableSize(2049)
    );
    let mut bad = LOCATION;
    bad.pba_offset = 0x5004;
    assert!(matches!(
        Msix::new(4, bad, rec.clone()),
        Err(MsixError::Unaligned("PBA", 0x5004))
    ));
    bad = LOCATION;
    bad.table_bar = 6;
    assert!(matches!(
        Msix::new(4, bad, rec.clone()),
        Err(MsixError::BadBar("table", 6))
    ));
    let m = Msix::new(2048, LOCATION, rec).unwrap();
    assert_eq!(m.table_bytes(), 2048 * 16);
    assert_eq!(m.pba_bytes(), 256);
    assert_eq!(pba_bytes(65), 16);
}

#[test]
fn capability_bytes_and_control() {
    let (mut m, rec) = msix(3);
    let cap = m.capability(0x50);
    assert_eq!(cap, [0x11, 0x50, 2, 0, 0x00, 0x40, 0, 0, 0x00, 0x50, 0, 0]);
    // A 16-bit write of message control with enable + function mask; the table size
    // field is read-only.
    m.write_capability(2, &0xc0ffu16.to_le_bytes());
    assert!(m.enabled() && m.function_masked());
    assert_eq!(m.message_control(), 0xc002);
    // A byte write of the high half clears the mask.
    m.write_capability(3, &[0x80]);
    assert!(m.enabled() && !m.function_masked());
    // A dword write of the whole first dword (ID and next are read-only).
    m.write_capability(0, &[0xff, 0xff, 0xff, 0x00]);
    assert!(!m.enabled());
    // Writes to the offsets are ignored.
    m.write_capability(4, &[0xff; 8]);
    assert_eq!(m.capability(0)[4..], cap[4..]);
    // All entries stayed masked: nothing to tell the target.
    assert!(rec.take().is_empty());
}

#[test]
fn table_reads_and_writes() {
    let (mut m, _rec) = msix(2);
    program(&mut m, 1, 0x1_fee0_1000, 0x4041);
    let mut entry = [0u8; 16];
    m.read_table(16, &mut entry);
    assert_eq!(&entry[0..8], &0x1_fee0_1000u64.to_le_bytes());
    assert_eq!(&entry[8..12], &0x4041u32.to_le_bytes());
    assert_eq!(&entry[12..16], &1u32.to_le_bytes());
    // Reads of any size; bytes past the table read as zero.
    let mut two = [0u8; 2];
    m.read_table(17, &mut two);
    assert_eq!(two, [0x10, 0xe0]);
    let mut tail = [0xaau8; 4];
    m.read_table(30, &mut tail);
    assert_eq!(tail, [0, 0, 0, 0]);
    m.read_table(u64::MAX - 1, &mut tail);
    assert_eq!(tail, [0; 4]);
    // Unaligned and odd-sized writes are ignored.
    m.write_table(16, &[0xff]);
    m.write_table(18, &[0xff; 4]);
    m.write_table(20, &[0xff; 8]);
    m.write_table(16, &[0xff; 2]);
    m.write_table(u64::MAX - 3, &[0xff; 4]);
    m.write_table(32, &[0xff; 4]);
    let mut again = [0u8; 16];
    m.read_table(16, &mut again);
    assert_eq!(again, entry);
    // Reserved vector-control bits read as zero.
    m.write_table(28, &0xffff_fffeu32.to_le_bytes());
    m.read_table(28, &mut tail);
    assert_eq!(tail, [0; 4]);
}

#[test]
fn updates_follow_the_effective_message() {
    let (mut m, rec) = msix(2);
    program(&mut m, 0, 0xfee0_0000, 0x30);
    // Masked and disabled: no effective change yet.
    assert!(rec.take().is_empty());
    unmask(&mut m, 0);
    assert!(rec.take().is_empty(), "still disabled");
    m.set_control(true, false);
    assert_eq!(rec.take(), [Event::Update(0, msg(0xfee0_0000, 0x30))]);
    // Reprogramming an unmasked entry publishes each change.
    m.write_table(8, &0x31u32.to_le_bytes());
    assert_eq!(rec.take(), [Event::Update(0, msg(0xfee0_0000, 0x31))]);
    // The same value again is no change.
    m.write_table(8, &0x31u32.to_le_bytes());
    assert!(rec.take().is_empty());
    mask(&mut m, 0);
    assert_eq!(rec.take(), [Event::Update(0, None)]);
    unmask(&mut m, 0);
    m.set_control(true, true);
    assert_eq!(
        rec.take(),
        [
            Event::Update(0, msg(0xfee0_0000, 0x31)),
            Event::Update(0, None)
        ]
    );
    m.set_control(false, false);
    assert!(rec.take().is_empty(), "masked then disabled: still None");
    m.set_control(true, false);
    assert_eq!(rec.take(), [Event::Update(0, msg(0xfee0_0000, 0x31))]);
    m.set_control(false, false);
    assert_eq!(rec.take(), [Event::Update(0, None)]);
}

#[test]
fn notify_fires_or_holds_pending() {
    let (mut m, rec) = msix(70);
    assert_eq!(m.notify(3), Notified::Disabled);
    assert_eq!(m.notify(70), Notified::NoSuchVector);
    m.set_control(true, false);
    // Entry 65 is masked: the bit goes to the second PBA word.
    assert_eq!(m.notify(65), Notified::Pending);
    assert!(m.is_pending(65));
    let mut pba = [0u8; 16];
    m.read_pba(0, &mut pba);
    assert_eq!(u64::from_le_bytes(pba[8..16].try_into().unwrap()), 2);
    // The PBA is read-only.
    m.write_pba(8, &[0; 8]);
    assert!(m.is_pending(65));
    program(&mut m, 65, 0xfee0_0000, 0x41);
    assert!(rec.take().is_empty());
    // Unmasking publishes the message, then delivers the pending vector once.
    unmask(&mut m, 65);
    assert_eq!(
        rec.take(),
        [Event::Update(65, msg(0xfee0_0000, 0x41)), Event::Fire(65)]
    );
    assert!(!m.is_pending(65));
    assert_eq!(m.notify(65), Notified::Fired);
    assert_eq!(rec.take(), [Event::Fire(65)]);
    // Function mask: pending, delivered when the function is unmasked.
    m.set_control(true, true);
    rec.take();
    assert_eq!(m.notify(65), Notified::Pending);
    assert_eq!(m.notify(65), Notified::Pending);
    assert!(rec.take().is_empty());
    m.set_control(true, false);
    assert_eq!(
        rec.take(),
        [Event::Update(65, msg(0xfee0_0000, 0x41)), Event::Fire(65)]
    );
}

#[test]
fn reset_and_save_restore() {
    let (mut m, rec) = msix(3);
    program(&mut m, 2, 0xfee0_2000, 0x52);
    unmask(&mut m, 2);
    m.set_control(true, false);
    assert_eq!(m.notify(1), Notified::Pending);
    let saved = m.save();
    rec.take();

    m.reset();
    assert_eq!(rec.take(), [Event::Update(2, None)]);
    assert_eq!(m.message_control(), 2);
    assert!(!m.is_pending(1));

    let (mut other, other_rec) = msix(3);
    other.restore(&saved).unwrap();
    assert_eq!(other.save(), saved);
    assert!(other.is_pending(1));
    // Restore tells the target about every vector.
    assert_eq!(
        other_rec.take(),
        [
            Event::Update(0, None),
            Event::Update(1, None),
            Event::Update(2, msg(0xfee0_2000, 0x52)),
        ]
    );
    // Serde round trip.
    let json = serde_json::to_string(&saved).unwrap();
    assert_eq!(serde_json::from_str::<MsixState>(&json).unwrap(), saved);
}

#[test]
fn restore_refuses_what_cannot_be() {
    let (mut m, rec) = msix(3);
    let good = m.save();
    let mut bad = good.clone();
    bad.table.pop();
    assert!(m.restore(&bad).is_err());
    let mut bad = good.clone();
    bad.pending.push(0);
    assert!(m.restore(&bad).is_err());
    let mut bad = good.clone();
    bad.table[1].vector_control = 2;
    assert!(m.restore(&bad).is_err());
    let mut bad = good.clone();
    bad.pending[0] = 1 << 3;
    assert!(m.restore(&bad).is_err());
    assert!(rec.take().is_empty());
    assert_eq!(m.save(), good);
}

#[test]
fn random_accesses_never_panic_and_keep_the_invariants() {
    let (mut m, rec) = msix(70);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..50_000 {
        let r = next();
        let len = [0usize, 1, 2, 3, 4, 8, 16][(r % 7) as usize];
        let offset = match (r >> 8) % 4 {
            0 => next(),
            1 => next() % (m.table_bytes() + 32),
            _ => (next() % 70) * ENTRY_SIZE + [0, 4, 8, 12][(r >> 16) as usize % 4],
        };
        let mut data = next().to_le_bytes().repeat(2);
        data.truncate(len);
        match (r >> 24) % 7 {
            0 => m.read_table(offset, &mut data),
            1 | 2 => m.write_table(offset, &data),
            3 => m.read_pba(offset, &mut data),
            4 => m.write_capability((next() % 16) as usize, &data),
            5 => {
                m.notify((next() % 80) as u16);
            }
            _ => m.write_pba(offset, &data),
        }
    }
    // A vector is never both deliverable and pending.
    for v in 0..70 {
        assert!(!(m.is_pending(v) && m.effective(usize::from(v)).is_some()));
    }
    // Every event was of an existing vector, and some were fires; the state still saves
    // and restores.
    let events = rec.take();
    assert!(events
        .iter()
        .all(|e| matches!(e, Event::Fire(v) | Event::Update(v, _) if *v < 70)));
    let fires = events
        .iter()
        .filter(|e| matches!(e, Event::Fire(_)))
        .count();
    assert!(fires > 10, "{fires} fires");
    let saved = m.save();
    m.restore(&saved).unwrap();
}

/// A target whose every vector has a kernel route: a pipe's read end stands for it.
struct WithIrqfd(std::fs::File);

impl MsiTarget for WithIrqfd {
    fn update(&self, _: u16, _: Option<MsiMessage>) {}
    fn fire(&self, _: u16) {}
    fn irqfd(&self, _: u16) -> Option<std::os::fd::OwnedFd> {
        self.0.try_clone().ok().map(Into::into)
    }
}

#[test]
fn the_kernel_route_is_handed_out_only_while_msix_is_enabled_and_in_the_table() {
    let file = std::fs::File::open("/dev/null").unwrap();
    let mut m = Msix::new(2, LOCATION, Arc::new(WithIrqfd(file))).unwrap();
    assert!(m.irqfd(0).is_none(), "MSI-X disabled");
    m.set_control(true, false);
    assert!(m.irqfd(0).is_some());
    assert!(m.irqfd(1).is_some());
    assert!(m.irqfd(2).is_none(), "beyond the table");
    let (plain, _) = msix(2);
    assert!(plain.irqfd(0).is_none(), "a target without kernel routes");
}
