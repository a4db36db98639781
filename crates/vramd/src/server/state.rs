//! What a new daemon needs to take over from one that stopped: every tenant (name, process,
//! class, guarantee, limit) and what it holds (grant ids and sizes, charges), kept in a file
//! beside the socket.
//!
//! Why a file suffices: a daemon that stops does not take the memory with it. The memory a tenant
//! was granted lives as long as the tenant keeps it imported (a CUDA handle, a memfd), so after a
//! crash or an upgrade the tenants still hold exactly what they held; only the books are lost. The
//! file restores the books, not the memory, and lives on a tmpfs such as `/run` (gone at reboot,
//! when no tenant is left either). It is rewritten whole (to a temporary file, then renamed) when
//! the books changed, at most every [`SAVE_EVERY`]; a reconnecting tenant says what it holds, and
//! the difference of those last moments is settled then (`Slot::resume`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use vram_core::Bytes;
use vram_proto::GrantId;

/// How often, at most, the file is rewritten while the books change.
pub const SAVE_EVERY: Duration = Duration::from_millis(100);

/// The file's format version; a file of another version is set aside, not read.
const FORMAT: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Saved {
    pub format: u32,
    /// The daemon that wrote it.
    pub daemon_pid: u32,
    /// The next grant id per device: a new daemon starts above it, so no id is given twice.
    pub next_grant: Vec<u64>,
    pub tenants: Vec<SavedTenant>,
    /// The tenants declared at run time (admin `Declare`), put in force again before tenants are
    /// adopted.
    #[serde(default)]
    pub declarations: Vec<SavedDeclaration>,
}

/// A run-time declaration and the UUID of its device, which finds the device again if the daemon
/// numbers its devices otherwise after the restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedDeclaration {
    pub uuid: String,
    pub declaration: vram_proto::Declaration,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedTenant {
    pub gpu: u32,
    /// The GPU's UUID, which finds it again if the daemon numbers its devices otherwise after
    /// the restart (a GPU gone, another device list); empty: `gpu` decides.
    #[serde(default)]
    pub uuid: String,
    pub name: String,
    pub class: String,
    pub guarantee: Bytes,
    pub limit: Bytes,
    pub pid: u32,
    pub uid: u32,
    /// The process's start time (`/proc/PID/stat`, clock ticks since boot): a pid reused by
    /// another process is not taken for the tenant.
    pub start_time: u64,
    pub grants: Vec<(GrantId, Bytes)>,
    pub charged: Bytes,
    /// An invitation to join the tenant not yet taken (`vramd run` registered it and started the
    /// program), so that the program can still join after a restart. The file is the daemon's
    /// alone (mode 0600), as the token is a secret.
    #[serde(default)]
    pub invitation: Option<String>,
}

impl Saved {
    pub fn new(
        next_grant: Vec<u64>,
        tenants: Vec<SavedTenant>,
        declarations: Vec<SavedDeclaration>,
    ) -> Saved {
        Saved {
            format: FORMAT,
            daemon_pid: std::process::id(),
            next_grant,
            tenants,
            declarations,
        }
    }
}

/// The state file of the daemon listening on `socket`.
pub fn path_for(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(".state");
    PathBuf::from(p)
}

/// Writes `saved` to `path` whole: a reader finds the old file or the new one, never a part.
/// The new one is written to a file of a fresh name beside it (created, never opened if it
/// exists: no link planted there is followed), mode 0600, then renamed over it.
pub fn save(path: &Path, saved: &Saved) -> anyhow::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let text = serde_json::to_vec(saved)?;
    let mut f = tempfile::Builder::new()
        .prefix(".vramd-state-")
        .tempfile_in(dir)
        .with_context(|| format!("cannot write a state file in {}", dir.display()))?;
    f.write_all(&text)
        .with_context(|| format!("cannot write {}", f.path().display()))?;
    f.persist(path)
        .with_context(|| format!("cannot replace {}", path.display()))?;
    Ok(())
}

/// The state a stopped daemon left, if any. A file that does not parse, is of another format or
/// is not the daemon's own ([`read_own`]) is renamed aside (`.unreadable`) with the reason, so
/// that it is neither lost nor read again.
pub fn load(path: &Path) -> Option<Saved> {
    let problem = match read_own(path) {
        Ok(None) => return None,
        Err(e) if e.kind() != std::io::ErrorKind::PermissionDenied => {
            tracing::warn!(path = %path.display(), "cannot read the state file: {e}");
            return None;
        }
        Err(e) => e.to_string(),
        Ok(Some(bytes)) => match serde_json::from_slice::<Saved>(&bytes) {
            Ok(s) if s.format == FORMAT => return Some(s),
            Ok(s) => format!("format {} (this daemon reads {FORMAT})", s.format),
            Err(e) => e.to_string(),
        },
    };
    let aside = path.with_extension("state.unreadable");
    tracing::warn!(
        path = %path.display(), aside = %aside.display(),
        "the state file cannot be used ({problem}); set aside, tenants are not adopted"
    );
    let _ = std::fs::rename(path, aside);
    None
}

/// The state file's bytes (`None` where there is none), if the file is the daemon's own: a
/// regular file (not a link) of its uid that no one else may write. Its content is trusted (it
/// books memory to tenants and names the processes to adopt), so a file another user could
/// have written is refused (`PermissionDenied`, with the reason).
fn read_own(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    use std::os::unix::fs::MetadataExt;
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        other => other?,
    };
    let me = rustix::process::geteuid().as_raw();
    let refuse = |why: String| {
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            why,
        ))
    };
    if !meta.file_type().is_file() {
        return refuse("not a regular file".into());
    }
    if meta.uid() != me {
        return refuse(format!(
            "owned by uid {}, not the daemon's {me}",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "mode {:o}: others may write it",
            meta.mode() & 0o777
        ));
    }
    std::fs::read(path).map(Some)
}

/// What the tenants of a daemon before, still running, hold on each of the devices whose UUIDs
/// are `uuids` (in that order), by the state file beside `socket`; a tenant finds its device as
/// adoption finds it, by UUID though the numbering changed (read only: adoption happens when the
/// server starts).
pub fn held_by_live_tenants(socket: &Path, uuids: &[String]) -> Vec<Bytes> {
    let mut held = vec![Bytes::ZERO; uuids.len()];
    let Ok(Some(bytes)) = read_own(&path_for(socket)) else {
        return held;
    };
    let Ok(saved) = serde_json::from_slice::<Saved>(&bytes) else {
        return held;
    };
    for t in &saved.tenants {
        if let Some(i) = slot_of(t, uuids).filter(|_| still_running(t.pid, t.start_time)) {
            let grants = t.grants.iter().map(|g| g.1);
            held[i] = grants.fold(held[i], Bytes::saturating_add);
        }
    }
    held
}

/// The time now in nanoseconds since the Unix epoch (0 for a clock before it).
fn nanos_since_epoch() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The start time of process `pid` (clock ticks since boot, field 22 of `/proc/PID/stat`), or
/// `None` if there is no such process (or it is a zombie: it holds no memory any more).
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: split after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // `rest` starts at field 3 (state); the start time is field 22.
    fields.nth(22 - 4)?.parse().ok()
}

/// Whether the process that registered as a tenant is still the one running under `pid`.
pub fn still_running(pid: u32, start_time: u64) -> bool {
    process_start_time(pid) == Some(start_time)
}

/// Keeps the state file current: rewrites it when the books changed (at most every
/// [`SAVE_EVERY`]), and drops adopted tenants whose process went without reconnecting.
pub(super) struct Keeper {
    path: PathBuf,
    /// Held while the file is written (the housekeeping thread and the shutdown both write, through
    /// one temporary file); `true` once the final state is written at shutdown: nothing is
    /// written after it.
    done: std::sync::Mutex<bool>,
    /// The last write failed: the next round writes again, changed or not (the books it failed
    /// to save may not change again for a long time).
    unsaved: std::sync::atomic::AtomicBool,
    /// The run-time declarations the file was last written with: a change is written too.
    declarations: std::sync::Mutex<Vec<SavedDeclaration>>,
    /// Tenants of the daemon before on a device this daemon does not have: written again while
    /// their process lives.
    unplaced: std::sync::Mutex<Vec<SavedTenant>>,
}

impl Keeper {
    /// Adopts the tenants the daemon before left (tenants whose process is gone are skipped) and
    /// writes the file anew.
    pub(super) fn adopt(daemon: &super::Daemon, socket: &Path) -> Keeper {
        let path = path_for(socket);
        let saved = load(&path);
        let mut unplaced = Vec::new();
        // Grant ids start at this start's time in nanoseconds, and well above any id the daemon
        // before saved (on any device: they may be numbered otherwise now, and it may have given
        // more in the moments its file lacks). A daemon gives fewer than one id a nanosecond, so
        // a tenant of an earlier daemon whose file is gone, reconnecting with the ids it holds,
        // cannot name a grant of this one (unless the clock was set back since). Shared-buffer
        // ids likewise: buffers do not outlive their daemon, and a reader still holding an
        // earlier one's id must find nothing by it, not a buffer created since.
        let next = saved
            .iter()
            .flat_map(|s| s.next_grant.iter().copied())
            .max()
            .unwrap_or(1)
            .saturating_add(1 << 24)
            .max(nanos_since_epoch());
        for slot in &daemon.slots {
            slot.start_ids_at(next);
        }
        if let Some(saved) = saved {
            let mut adopted = 0;
            let uuids: Vec<String> = daemon.slots.iter().map(|s| s.desc().uuid).collect();
            // Declarations first: an adopted tenant is admitted under them as it was before.
            for d in &saved.declarations {
                let Some(gpu) = uuids.iter().position(|u| *u == d.uuid) else {
                    tracing::warn!(
                        tenant = d.declaration.name,
                        uuid = d.uuid,
                        "run-time declaration not restored: no such device now"
                    );
                    continue;
                };
                let gpu = u32::try_from(gpu).expect("device index fits u32");
                super::admin::restore(
                    daemon,
                    vram_proto::Declaration {
                        gpu,
                        ..d.declaration.clone()
                    },
                );
            }
            for t in &saved.tenants {
                let Some(slot) = slot_of(t, &uuids).map(|i| &daemon.slots[i]) else {
                    // Kept in the file while its process lives: a later start that sees the
                    // device again (a GPU back on the bus) adopts it there.
                    let lives = still_running(t.pid, t.start_time);
                    tracing::warn!(
                        tenant = t.name,
                        gpu = t.gpu,
                        uuid = t.uuid,
                        kept_in_state_file = lives,
                        "not adopted: no such device now"
                    );
                    if lives {
                        unplaced.push(t.clone());
                    }
                    continue;
                };
                let held: Bytes = t.grants.iter().map(|g| g.1).sum();
                match slot.adopt(t) {
                    Ok(_) => {
                        adopted += 1;
                        tracing::info!(
                            tenant = t.name, pid = t.pid, held = %held, charged = %t.charged,
                            grants = t.grants.len(), "adopted a tenant of the daemon before"
                        );
                    }
                    Err(why) => tracing::info!(tenant = t.name, pid = t.pid, "not adopted: {why}"),
                }
            }
            tracing::info!(
                adopted,
                of = saved.tenants.len(),
                previous_pid = saved.daemon_pid,
                "took over from the daemon before"
            );
        }
        let keeper = Keeper {
            path,
            done: std::sync::Mutex::new(false),
            unsaved: std::sync::atomic::AtomicBool::new(false),
            declarations: std::sync::Mutex::new(Vec::new()),
            unplaced: std::sync::Mutex::new(unplaced),
        };
        keeper.write(daemon, true);
        keeper
    }

    /// Writes the file if the books changed (or `force`).
    fn write(&self, daemon: &super::Daemon, force: bool) {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        self.write_locked(&done, daemon, force);
    }

    /// [`Keeper::write`] with the write lock held (`done` its guard).
    fn write_locked(&self, done: &bool, daemon: &super::Daemon, force: bool) {
        if *done {
            return;
        }
        let mut next = Vec::new();
        let mut tenants = Vec::new();
        use std::sync::atomic::Ordering::Relaxed;
        let unsaved = self.unsaved.load(Relaxed);
        let mut changed = force || unsaved;
        // Copied out before any slot's lock is taken (the declarations' lock comes first).
        let declarations: Vec<SavedDeclaration> = daemon
            .declared
            .lock()
            .values()
            .map(|d| SavedDeclaration {
                uuid: daemon
                    .slots
                    .get(d.gpu as usize)
                    .map(|s| s.uuid())
                    .unwrap_or_default(),
                declaration: d.clone(),
            })
            .collect();
        {
            let mut last = self.declarations.lock().unwrap_or_else(|p| p.into_inner());
            if *last != declarations {
                *last = declarations.clone();
                changed = true;
            }
        }
        for slot in &daemon.slots {
            let (n, t, dirty) = slot.saved();
            next.push(n);
            tenants.extend(t);
            changed |= dirty;
        }
        {
            let mut unplaced = self.unplaced.lock().unwrap_or_else(|p| p.into_inner());
            let before = unplaced.len();
            unplaced.retain(|t| still_running(t.pid, t.start_time));
            changed |= unplaced.len() != before;
            tenants.extend(unplaced.iter().cloned());
        }
        if changed {
            match save(&self.path, &Saved::new(next, tenants, declarations)) {
                Ok(()) if unsaved => {
                    self.unsaved.store(false, Relaxed);
                    tracing::info!(path = %self.path.display(), "the daemon's state is saved again");
                }
                Ok(()) => {}
                // Said once, not at every round it is tried again.
                Err(e) if !unsaved => {
                    self.unsaved.store(true, Relaxed);
                    tracing::warn!(
                        "cannot save the daemon's state (tried again each round until it is): {}",
                        crate::logging::Chain(&e)
                    );
                }
                Err(_) => {}
            }
        }
    }

    /// One round of housekeeping (see the type's documentation).
    pub(super) fn tick(&self, daemon: &super::Daemon) {
        for slot in &daemon.slots {
            for (name, held) in slot.reap_pending() {
                tracing::info!(
                    tenant = name, held = %held,
                    "adopted tenant gone without reconnecting; its books are closed"
                );
            }
        }
        self.write(daemon, false);
    }

    /// At shutdown, before the connections close: the file keeps every tenant and what it holds,
    /// for the daemon that comes next; nothing is written after this.
    pub(super) fn final_save(&self, daemon: &super::Daemon) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        self.write_locked(&done, daemon, true);
        *done = true;
    }
}

/// Which of the devices now (their UUIDs, by index) a saved tenant's GPU is: by UUID where the
/// file names it, else by index.
fn slot_of(t: &SavedTenant, uuids: &[String]) -> Option<usize> {
    if t.uuid.is_empty() {
        let i = t.gpu as usize;
        return (i < uuids.len()).then_some(i);
    }
    uuids.iter().position(|u| *u == t.uuid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory live tenants hold is found on their device by UUID, as adoption finds it, not
    /// by the number it had before.
    #[test]
    fn live_tenants_memory_is_found_on_their_device_by_uuid() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("s.sock");
        let me = std::process::id();
        let tenant = |gpu, uuid: &str, mib| SavedTenant {
            gpu,
            uuid: uuid.into(),
            name: format!("t{gpu}"),
            class: "normal".into(),
            guarantee: Bytes::ZERO,
            limit: Bytes::gib(8),
            pid: me,
            uid: 0,
            start_time: process_start_time(me).unwrap(),
            grants: vec![(GrantId(u64::from(gpu) + 1), Bytes::mib(mib))],
            charged: Bytes::ZERO,
            invitation: None,
        };
        let saved = Saved {
            format: FORMAT,
            daemon_pid: 1,
            next_grant: vec![10, 10],
            tenants: vec![tenant(0, "GPU-a", 64), tenant(1, "GPU-b", 128)],
            declarations: Vec::new(),
        };
        std::fs::write(path_for(&socket), serde_json::to_vec(&saved).unwrap()).unwrap();
        // GPU-a is gone and GPU-b is the daemon's device 0 now.
        let now = ["GPU-b".to_string(), "GPU-c".to_string()];
        assert_eq!(
            held_by_live_tenants(&socket, &now),
            vec![Bytes::mib(128), Bytes::ZERO]
        );
    }

    #[test]
    fn a_saved_tenant_finds_its_gpu_by_uuid_though_the_numbers_changed() {
        let mut t = SavedTenant {
            gpu: 2,
            uuid: "GPU-c".into(),
            name: "trainer".into(),
            class: "normal".into(),
            guarantee: Bytes::ZERO,
            limit: Bytes::gib(8),
            pid: 1,
            uid: 0,
            start_time: 0,
            grants: Vec::new(),
            charged: Bytes::ZERO,
            invitation: None,
        };
        // GPU-b is gone: GPU-c is the daemon's device 1 now.
        let now = [
            "GPU-a".to_string(),
            "GPU-c".to_string(),
            "GPU-d".to_string(),
        ];
        assert_eq!(slot_of(&t, &now), Some(1));
        t.uuid = "GPU-b".into();
        assert_eq!(
            slot_of(&t, &now),
            None,
            "its GPU is gone: not adopted elsewhere"
        );
        // A file without UUIDs: the index.
        t.uuid.clear();
        assert_eq!(slot_of(&t, &now), Some(2));
        t.gpu = 3;
        assert_eq!(slot_of(&t, &now), None);
    }

    #[test]
    fn a_saved_state_reads_back_and_a_bad_file_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vramd.sock.state");
        assert_eq!(load(&path), None);
        let saved = Saved::new(
            vec![7],
            vec![SavedTenant {
                gpu: 0,
                uuid: "host-0".into(),
                name: "trainer".into(),
                class: "high".into(),
                guarantee: Bytes::gib(4),
                limit: Bytes::gib(8),
                pid: 1234,
                uid: 0,
                start_time: 99,
                grants: vec![(GrantId(3), Bytes::mib(2))],
                charged: Bytes::mib(64),
                invitation: Some("00ff".into()),
            }],
            vec![SavedDeclaration {
                uuid: "host-0".into(),
                declaration: vram_proto::Declaration {
                    name: "k8s-claim".into(),
                    gpu: 0,
                    class: "high".into(),
                    guarantee: Bytes::gib(2),
                    limit: None,
                    owners: vec![1000],
                },
            }],
        );
        save(&path, &saved).unwrap();
        assert_eq!(load(&path), Some(saved));
        std::fs::write(&path, b"{ not json").unwrap();
        assert_eq!(load(&path), None);
        assert!(!path.exists());
        assert!(dir.path().join("vramd.sock.state.unreadable").exists());
    }

    /// The file is trusted only as the daemon's own: one others may write, or a link, is set
    /// aside unread; writing it never follows a link planted beside it.
    #[test]
    fn a_state_file_others_could_write_is_not_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vramd.sock.state");
        let saved = Saved::new(vec![7], Vec::new(), Vec::new());
        save(&path, &saved).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(load(&path), None);
        assert!(dir.path().join("vramd.sock.state.unreadable").exists());

        let elsewhere = dir.path().join("elsewhere");
        save(&elsewhere, &saved).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
        assert_eq!(load(&path), None, "a link is not followed");
        // Saving replaces a link in the state's place; the file it pointed to is left as it was.
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
        let before = std::fs::read(&elsewhere).unwrap();
        save(&path, &Saved::new(vec![8], Vec::new(), Vec::new())).unwrap();
        assert_eq!(std::fs::read(&elsewhere).unwrap(), before);
        assert_eq!(load(&path).map(|s| s.next_grant), Some(vec![8]));
    }

    #[test]
    fn this_process_is_running_and_a_made_up_start_time_is_not_it() {
        let me = std::process::id();
        let start = process_start_time(me).expect("our own stat");
        assert!(still_running(me, start));
        assert!(!still_running(me, start + 1));
        assert_eq!(process_start_time(u32::MAX), None);
    }
}
