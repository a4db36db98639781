//! The plugin's checkpoint: every claim it prepared and has not unprepared, with the declaration
//! it made for it, and the claims it unprepared lately. Written whole (a temporary file renamed
//! over it) before the kubelet hears of a change, so that a plugin restarted at any point knows
//! what it promised: a prepare retried is answered as before, an unprepare retried is done.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};

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

#[derive(Debug, Default, Serialize, Deserialize)]
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

    /// Records claim `uid` as prepared; on disk once the returned [`Save`] is written.
    pub fn insert(&mut self, uid: &str, p: Prepared) -> Save {
        self.file.unprepared.retain(|u| u != uid);
        self.file.prepared.insert(uid.to_string(), p);
        self.save()
    }

    /// Records claim `uid` as unprepared; on disk once the returned [`Save`] is written.
    pub fn remove(&mut self, uid: &str) -> Save {
        self.file.prepared.remove(uid);
        if !self.was_unprepared(uid) {
            self.file.unprepared.push_back(uid.to_string());
        }
        while self.file.unprepared.len() > REMEMBERED {
            self.file.unprepared.pop_front();
        }
        self.save()
    }

    fn save(&self) -> Save {
        Save {
            path: self.path.clone(),
            bytes: serde_json::to_vec_pretty(&self.file).expect("serializes"),
        }
    }
}

/// The checkpoint as it stands after a change, to be written (a separate step, so that a caller
/// on an async runtime can write it off the runtime's threads).
#[must_use = "the change is on disk only once written"]
pub struct Save {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl Save {
    /// Writes the checkpoint whole: a temporary file renamed over it.
    pub fn write(self) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, &self.bytes)?;
        std::fs::rename(&tmp, &self.path)
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
        c.insert("u", p.clone()).write().unwrap();
        let c2 = Checkpoint::load(&path).unwrap();
        assert_eq!(c2.get("u"), Some(&p));
        let mut c2 = c2;
        c2.remove("u").write().unwrap();
        let c3 = Checkpoint::load(&path).unwrap();
        assert!(c3.get("u").is_none());
        assert!(c3.was_unprepared("u"));
        std::fs::write(&path, b"{not json").unwrap();
        assert!(Checkpoint::load(&path).is_err());
    }
}
