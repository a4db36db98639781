//! The daemon's listening socket: bound only where nothing else is in the way, and removed only
//! if it is still the one this daemon bound. The daemon often runs as root: deleting whatever
//! lies at a configured path would let a typo in `socket` remove any file.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Why the socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("cannot create socket directory {dir}: {source}")]
    Directory {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot inspect {path}: {source}")]
    Inspect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path} exists and is not a socket (a {kind}); refusing to remove it: remove it yourself \
         or choose another --socket"
    )]
    NotASocket { path: PathBuf, kind: &'static str },
    #[error("another vramd is already serving on {path}; stop it or choose another --socket")]
    InUse { path: PathBuf },
    #[error("cannot remove the stale socket {path}: {source}")]
    RemoveStale {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot bind {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot set mode {mode:o} on {path}: {source}")]
    Mode {
        path: PathBuf,
        mode: u32,
        source: std::io::Error,
    },
}

/// The socket file this daemon created, known by device, inode and change time (an inode number
/// alone may be reused by a file made after ours was removed). Dropping it removes the file if it
/// is still that one.
#[derive(Debug)]
pub struct OwnSocket {
    path: PathBuf,
    dev: u64,
    ino: u64,
    ctime: (i64, i64),
}

impl OwnSocket {
    /// Whether `path` is still the socket this daemon bound.
    fn still_ours(&self) -> bool {
        std::fs::symlink_metadata(&self.path).is_ok_and(|m| {
            m.file_type().is_socket()
                && m.dev() == self.dev
                && m.ino() == self.ino
                && (m.ctime(), m.ctime_nsec()) == self.ctime
        })
    }
}

impl Drop for OwnSocket {
    fn drop(&mut self) {
        if self.still_ours() {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(path = %self.path.display(), "cannot remove the socket: {e}");
            }
        } else if self.path.exists() {
            tracing::warn!(
                path = %self.path.display(),
                "the socket path is no longer this daemon's socket (replaced by another); left alone"
            );
        }
    }
}

/// Binds a listening socket at `path` with permission bits `mode`. What is already there: a
/// socket a live daemon answers on is refused; a dead one's (stale) is removed; anything else
/// (a file, a directory, a link) is refused and left alone.
pub fn bind(path: &Path, mode: u32) -> Result<(UnixListener, OwnSocket), SocketError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| SocketError::Directory {
            dir: dir.to_path_buf(),
            source,
        })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(SocketError::InUse { path: path.into() });
            }
            std::fs::remove_file(path).map_err(|source| SocketError::RemoveStale {
                path: path.into(),
                source,
            })?;
            tracing::info!(path = %path.display(), "removed a stale socket (no daemon answered on it)");
        }
        Ok(m) => {
            return Err(SocketError::NotASocket {
                path: path.into(),
                kind: kind(&m.file_type()),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(SocketError::Inspect {
                path: path.into(),
                source,
            })
        }
    }
    let listener = UnixListener::bind(path).map_err(|source| SocketError::Bind {
        path: path.into(),
        source,
    })?;
    let mode_set = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode));
    let meta = std::fs::symlink_metadata(path);
    let Ok(meta) = meta else {
        let _ = std::fs::remove_file(path);
        return Err(SocketError::Inspect {
            path: path.into(),
            source: meta.expect_err("checked"),
        });
    };
    // From here on `own` removes the socket whatever way the daemon ends.
    let own = OwnSocket {
        path: path.into(),
        dev: meta.dev(),
        ino: meta.ino(),
        ctime: (meta.ctime(), meta.ctime_nsec()),
    };
    mode_set.map_err(|source| SocketError::Mode {
        path: path.into(),
        mode,
        source,
    })?;
    Ok((listener, own))
}

fn kind(t: &std::fs::FileType) -> &'static str {
    if t.is_file() {
        "regular file"
    } else if t.is_dir() {
        "directory"
    } else if t.is_symlink() {
        "symbolic link"
    } else if t.is_fifo() {
        "fifo"
    } else if t.is_block_device() || t.is_char_device() {
        "device node"
    } else {
        "file of another kind"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_stale_socket_is_replaced_and_only_ours_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        std::fs::write(&path, "keep").unwrap();
        let e = bind(&path, 0o660).unwrap_err();
        assert!(
            matches!(
                e,
                SocketError::NotASocket {
                    kind: "regular file",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "keep");
        std::fs::remove_file(&path).unwrap();

        let (listener, own) = bind(&path, 0o600).unwrap();
        assert!(matches!(bind(&path, 0o600), Err(SocketError::InUse { .. })));
        drop(listener);
        // A dead daemon's socket is stale: replaced.
        let (_l2, own2) = bind(&path, 0o600).unwrap();
        // The first owner's file is gone: dropping it leaves the second's alone.
        drop(own);
        assert!(path.exists());
        drop(own2);
        assert!(!path.exists());
    }
}
