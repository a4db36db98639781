//! The plugin's checkpoint: every claim it prepared and has not unprepared, with the declaration
//! it made for it, and the claims it unprepared lately. Written whole and flushed to the disk (a
//! temporary file renamed over it) before the kubelet hears of a change, and changed in memory
//! only once written, so that a plugin restarted at any point knows what it promised: a prepare
//! retried is answered as before, an unprepare retried is done.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use vram_proto::Declaration;

/// How many unprepared claims are remembered, so that a retried unprepare still succeeds.
const REMEMBERED: usize = 1024;

/// A claim prepared on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prepared {
    pub namespace: String,
    pub name: String,
    pub pool: String,
    pub device: String,
    pub requests: Vec<String>,
    /// What the daemon was told (the tenant, its guarantee and limit).
    pub declaration: Declaration,
    pub cdi_device_ids: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct File {
    /// By claim uid.
    prepared: BTreeMap<String, Prepared>,
    /// Claim uids unprepared lately, oldest first.
    unprepared: VecDeque<String>,
}

/// The checkpoint file and what it holds.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    file: File,
}

impl Checkpoint {
    /// Reads `path` (a missing file is an empty checkpoint).
    pub fn load(path: &Path) -> anyhow::Result<Checkpoint> {
        let file = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                anyhow::anyhow!("checkpoint {} is not readable: {e}", path.display())
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => File::default(),
            Err(e) => anyhow::bail!("cannot read checkpoint {}: {e}", path.display()),
        };
        Ok(Checkpoint {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn get(&self, uid: &str) -> Option<&Prepared> {
        self.file.prepared.get(uid)
    }

    pub fn prepared(&self) -> impl Iterator<Item = (&String, &Prepared)> {
        self.file.prepared.iter()
    }

    /// Whether claim `uid` was unprepared lately.
    pub fn was_unprepared(&self, uid: &str) -> bool {
        self.file.unprepared.iter().any(|u| u == uid)
    }

    /// The checkpoint with claim `uid` prepared: written by [`Change::write`], then taken in by
    /// [`Checkpoint::commit`]. Until both, this checkpoint is as it was, so a write that fails
    /// changes nothing.
    pub fn insert(&self, uid: &str, p: Prepared) -> Change {
        let mut file = self.file.clone();
        file.unprepared.retain(|u| u != uid);
        file.prepared.insert(uid.to_string(), p);
        self.change(file)
    }

    /// The checkpoint with claim `uid` unprepared (see [`Checkpoint::insert`]).
    pub fn remove(&self, uid: &str) -> Change {
        let mut file = self.file.clone();
        file.prepared.remove(uid);
        if !file.unprepared.iter().any(|u| u == uid) {
            file.unprepared.push_back(uid.to_string());
        }
        while file.unprepared.len() > REMEMBERED {
            file.unprepared.pop_front();
        }
        self.change(file)
    }

    /// Takes in a change once it is on disk.
    pub fn commit(&mut self, written: Written) {
        self.file = written.0.file;
    }

    fn change(&self, file: File) -> Change {
        Change {
            path: self.path.clone(),
            file,
        }
    }
}

/// The checkpoint as it would stand after a change, to be written (a separate step, so that a
/// caller on an async runtime can write it off the runtime's threads).
#[must_use = "the change is on disk only once written, and in the checkpoint once committed"]
pub struct Change {
    path: PathBuf,
    file: File,
}

/// A change on disk, for [`Checkpoint::commit`].
#[must_use = "the change is in the checkpoint only once committed"]
pub struct Written(Change);

impl Change {
    /// Writes the checkpoint whole and durably: a temporary file, flushed to the disk, renamed
    /// over it, and the directory flushed, so that a crash or power loss leaves the old
    /// checkpoint or the new one, never an empty or partial file.
    pub fn write(self) -> std::io::Result<Written> {
        use std::io::Write;
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        // A name of its own per write (process and count): no two writes share a temporary
        // file, whichever plugin process made them.
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .path
            .with_extension(format!("tmp.{}.{n}", std::process::id()));
        let written = std::fs::File::create(&tmp).and_then(|mut f| {
            f.write_all(&serde_json::to_vec_pretty(&self.file).expect("serializes"))?;
            f.sync_all()
        });
        let renamed = written.and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = renamed {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        // Renamed, the new checkpoint is the one on disk: a directory that cannot be flushed
        // now is said, not taken for a change not made (the caller would undo what the file
        // already records).
        if let Err(e) = std::fs::File::open(dir).and_then(|d| d.sync_all()) {
            tracing::warn!(dir = %dir.display(), "the checkpoint is written but its directory cannot be flushed: {e}");
        }
        Ok(Written(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vram_core::Bytes;

    #[test]
    fn what_was_prepared_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let p = Prepared {
            namespace: "ns".into(),
            name: "c".into(),
            pool: "node".into(),
            device: "gpu-0".into(),
            requests: vec!["mem".into()],
            declaration: Declaration {
                name: "k8s-u".into(),
                gpu: 0,
                class: "normal".into(),
                guarantee: Bytes::gib(1),
                limit: Some(Bytes::gib(2)),
                owners: vec![],
            },
            cdi_device_ids: vec!["vramd.io/claim=u".into()],
        };
        let mut c = Checkpoint::load(&path).unwrap();
        let written = c.insert("u", p.clone()).write().unwrap();
        assert!(
            c.get("u").is_none(),
            "in the checkpoint only once committed"
        );
        c.commit(written);
        assert_eq!(c.get("u"), Some(&p));
        let mut c2 = Checkpoint::load(&path).unwrap();
        assert_eq!(c2.get("u"), Some(&p));
        let written = c2.remove("u").write().unwrap();
        c2.commit(written);
        assert!(c2.was_unprepared("u"));
        let c3 = Checkpoint::load(&path).unwrap();
        assert!(c3.get("u").is_none());
        assert!(c3.was_unprepared("u"));
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "temporary files left: {left:?}");
        std::fs::write(&path, b"{not json").unwrap();
        assert!(Checkpoint::load(&path).is_err());
    }

    /// A change whose write fails leaves the checkpoint as it was, in memory and on disk.
    #[test]
    fn a_change_that_cannot_be_written_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("plugin");
        let c = Checkpoint::load(&folder.join("checkpoint.json")).unwrap();
        // The checkpoint's folder is a file now: nothing can be written under it.
        std::fs::write(&folder, b"").unwrap();
        let p = Prepared {
            namespace: "ns".into(),
            name: "c".into(),
            pool: "node".into(),
            device: "gpu-0".into(),
            requests: vec![],
            declaration: Declaration {
                name: "k8s-u".into(),
                gpu: 0,
                class: "normal".into(),
                guarantee: Bytes::gib(1),
                limit: None,
                owners: vec![],
            },
            cdi_device_ids: vec![],
        };
        assert!(c.insert("u", p).write().is_err());
        assert!(c.get("u").is_none());
        assert!(c.remove("v").write().is_err());
        assert!(!c.was_unprepared("v"));
    }
}
