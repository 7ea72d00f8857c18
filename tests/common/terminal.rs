//! A person at a terminal: a command runs in a tmux pane of a tmux server of its own; the
//! test reads the screen (with its scroll-back) and types as a person would.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

pub struct Terminal {
    /// The tmux server's socket name (`tmux -L`) and the session's name.
    name: String,
    /// Where the shell running the command writes its exit status.
    status_file: PathBuf,
}

impl Terminal {
    /// Starts `command` (its words quoted for the shell) in a 160×50 pane of a new tmux
    /// server named after `name` and this process.
    pub fn start(name: &str, command: &[String]) -> Self {
        let name = format!("ferrovm-{name}-{}", std::process::id());
        let status_file = std::env::temp_dir().join(format!("{name}.status"));
        let _ = std::fs::remove_file(&status_file);
        let words: Vec<String> = command.iter().map(|w| format!("'{w}'")).collect();
        let shell = format!("{}; echo $? > {}", words.join(" "), status_file.display());
        let terminal = Terminal { name, status_file };
        // The whole boot log stays in the scroll-back: a person could scroll back to it.
        terminal.tmux(&[
            "-f",
            "/dev/null",
            "start-server",
            ";",
            "set-option",
            "-g",
            "history-limit",
            "100000",
            ";",
            // The last screen stays readable when the command ends.
            "set-option",
            "-g",
            "-w",
            "remain-on-exit",
            "on",
            ";",
            "new-session",
            "-d",
            "-s",
            &terminal.name,
            "-x",
            "160",
            "-y",
            "50",
            &shell,
        ]);
        terminal
    }

    /// Runs `tmux -L NAME ARGS...` and returns its standard output.
    fn tmux(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.name)
            .args(args)
            .output()
            .expect("tmux");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Every line of the pane, scroll-back first, wrapped lines joined.
    pub fn lines(&self) -> Vec<String> {
        self.tmux(&["capture-pane", "-p", "-J", "-S", "-", "-t", &self.name])
            .lines()
            .map(|l| l.trim_end().to_string())
            .collect()
    }

    /// Waits until a line from index `from` on satisfies `found`, and returns its index.
    /// Fails when the command ends first.
    pub fn wait_for_line(
        &self,
        from: usize,
        limit: Duration,
        what: &str,
        found: impl Fn(&str) -> bool,
    ) -> usize {
        let start = Instant::now();
        loop {
            // Whether it had ended before the screen was read: then nothing more will come.
            let ended = self.status_file.exists();
            let lines = self.lines();
            if let Some(i) = lines.iter().skip(from).position(|l| found(l)) {
                return from + i;
            }
            assert!(
                !ended,
                "the command ended before {what} came:\n{}",
                lines.join("\n")
            );
            assert!(
                start.elapsed() < limit,
                "never saw {what} after line {from}:\n{}",
                lines.join("\n")
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Waits for `needle` anywhere on the screen or in its scroll-back.
    pub fn wait_for(&self, needle: &str, limit: Duration) -> usize {
        self.wait_for_line(0, limit, &format!("{needle:?}"), |l| l.contains(needle))
    }

    /// Types `text` and Enter.
    pub fn type_line(&self, text: &str) {
        self.tmux(&["send-keys", "-t", &self.name, "-l", text]);
        self.tmux(&["send-keys", "-t", &self.name, "Enter"]);
    }

    /// Waits for the command to end and returns its exit status as the shell printed it.
    pub fn wait_exit(&self, limit: Duration) -> String {
        let start = Instant::now();
        while !self.status_file.exists() {
            assert!(
                start.elapsed() < limit,
                "the command did not end:\n{}",
                self.lines().join("\n")
            );
            std::thread::sleep(Duration::from_millis(300));
        }
        std::fs::read_to_string(&self.status_file)
            .unwrap()
            .trim()
            .to_string()
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        self.tmux(&["kill-server"]);
        let _ = std::fs::remove_file(&self.status_file);
    }
}
