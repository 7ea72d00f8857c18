//! The launcher thread: creates the threads others ask for, so that they need not be allowed
//! to (see the crate documentation).

use std::io;
use std::sync::mpsc::{channel, sync_channel, Sender};
use std::sync::Mutex;
use std::thread::JoinHandle;

/// A thread creation to run on the launcher.
type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Launcher {
    jobs: Mutex<Sender<Job>>,
}

impl Launcher {
    /// Starts the launcher; `prepare` runs first on its thread (it installs the filter) and
    /// may refuse, which ends the launcher with that error. (Used where filters exist.)
    #[cfg_attr(
        not(all(target_os = "linux", target_arch = "x86_64")),
        allow(dead_code)
    )]
    pub fn start(
        prepare: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> io::Result<Self> {
        let (jobs, queue) = channel::<Job>();
        let (ready_tx, ready) = sync_channel(1);
        std::thread::Builder::new()
            .name("launcher".into())
            .spawn(move || {
                let prepared = prepare();
                let ok = prepared.is_ok();
                let _ = ready_tx.send(prepared);
                if ok {
                    // Ends when every sender is gone (never, in a running VMM).
                    for job in queue {
                        job();
                    }
                }
            })?;
        match ready.recv() {
            Ok(Ok(())) => Ok(Launcher {
                jobs: Mutex::new(jobs),
            }),
            Ok(Err(reason)) => Err(io::Error::other(reason)),
            Err(_) => Err(io::Error::other(
                "the launcher thread ended during start-up",
            )),
        }
    }

    /// Creates a thread named `name` running `body`, on the launcher's thread.
    pub fn spawn<T: Send + 'static>(
        &self,
        name: String,
        body: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<JoinHandle<T>> {
        let (reply, handle) = sync_channel(1);
        let job: Job = Box::new(move || {
            let _ = reply.send(std::thread::Builder::new().name(name).spawn(body));
        });
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job)
            .map_err(|_| io::Error::other("the thread launcher has stopped"))?;
        handle
            .recv()
            .map_err(|_| io::Error::other("the thread launcher has stopped"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_created_on_the_launcher_and_return_their_results() {
        let launcher = Launcher::start(|| Ok(())).unwrap();
        let handle = launcher
            .spawn("probe".into(), || {
                std::thread::current().name().map(str::to_owned)
            })
            .unwrap();
        assert_eq!(handle.join().unwrap().as_deref(), Some("probe"));
    }

    #[test]
    fn a_refused_preparation_is_an_error() {
        let err = Launcher::start(|| Err("no filter".into())).err().unwrap();
        assert!(err.to_string().contains("no filter"));
    }
}
