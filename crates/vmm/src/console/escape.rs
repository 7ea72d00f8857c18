//! The console's escape sequences, as QEMU's character multiplexer has them: Ctrl-A x
//! quits, Ctrl-A Ctrl-A sends one Ctrl-A to the guest, Ctrl-A h prints the list. Any other
//! key after Ctrl-A is swallowed, as in QEMU.

/// Ctrl-A, the escape character.
pub const ESCAPE: u8 = 0x01;

/// Printed for Ctrl-A h.
pub const HELP: &str = "\r\nC-a x    exit ferrovm\r\nC-a C-a  send C-a to the guest\r\nC-a h    \
                        print this help\r\n";

/// What the operator asked for with an escape sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Quit,
    Help,
}

/// Splits typed input into bytes for the guest and escape commands. Keeps its state
/// between reads: a Ctrl-A at the end of one read applies to the first byte of the next.
#[derive(Debug, Default)]
pub struct EscapeFilter {
    after_escape: bool,
}

impl EscapeFilter {
    /// Appends to `guest` the bytes of `input` meant for the guest, up to the first command,
    /// which it returns with the number of input bytes consumed (the rest is not looked at).
    pub fn filter(&mut self, input: &[u8], guest: &mut Vec<u8>) -> (usize, Option<Command>) {
        for (i, &byte) in input.iter().enumerate() {
            if !self.after_escape {
                if byte == ESCAPE {
                    self.after_escape = true;
                } else {
                    guest.push(byte);
                }
                continue;
            }
            self.after_escape = false;
            let command = match byte {
                b'x' | b'X' => Some(Command::Quit),
                b'h' | b'H' | b'?' => Some(Command::Help),
                ESCAPE => {
                    guest.push(ESCAPE);
                    None
                }
                _ => None,
            };
            if command.is_some() {
                return (i + 1, command);
            }
        }
        (input.len(), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(filter: &mut EscapeFilter, input: &[u8]) -> (Vec<u8>, usize, Option<Command>) {
        let mut guest = Vec::new();
        let (used, command) = filter.filter(input, &mut guest);
        (guest, used, command)
    }

    #[test]
    fn plain_input_passes_through() {
        let mut f = EscapeFilter::default();
        assert_eq!(run(&mut f, b"ls -l\r"), (b"ls -l\r".to_vec(), 6, None));
    }

    #[test]
    fn ctrl_a_x_quits_and_stops_there() {
        let mut f = EscapeFilter::default();
        assert_eq!(
            run(&mut f, b"ab\x01xcd"),
            (b"ab".to_vec(), 4, Some(Command::Quit))
        );
        assert_eq!(run(&mut f, b"\x01X").2, Some(Command::Quit));
    }

    #[test]
    fn ctrl_a_twice_is_one_literal_ctrl_a() {
        let mut f = EscapeFilter::default();
        assert_eq!(run(&mut f, b"a\x01\x01b"), (b"a\x01b".to_vec(), 4, None));
    }

    #[test]
    fn the_escape_spans_reads() {
        let mut f = EscapeFilter::default();
        assert_eq!(run(&mut f, b"a\x01"), (b"a".to_vec(), 2, None));
        assert_eq!(run(&mut f, b"x"), (vec![], 1, Some(Command::Quit)));
        assert_eq!(run(&mut f, b"\x01"), (vec![], 1, None));
        assert_eq!(run(&mut f, b"\x01z"), (b"\x01z".to_vec(), 2, None));
    }

    #[test]
    fn help_and_unknown_keys() {
        let mut f = EscapeFilter::default();
        assert_eq!(run(&mut f, b"\x01hq"), (vec![], 2, Some(Command::Help)));
        assert_eq!(run(&mut f, b"q\x01zq"), (b"qq".to_vec(), 4, None));
    }
}
