//! Tells a service manager how the daemon is doing, through the `sd_notify` protocol: one
//! datagram of `KEY=VALUE` lines to the Unix socket named by `$NOTIFY_SOCKET` (a path, or an
//! abstract name written `@name`). Without that variable nothing is sent: outside systemd (or
//! under a unit that is not `Type=notify`) this does nothing.
//!
//! `READY=1` once the daemon serves (its socket listening, metrics up), `RELOADING=1` and then
//! `READY=1` around a reload, `STOPPING=1` when it starts shutting down.

use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The environment variable systemd sets for `Type=notify` services.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Sends `state` (newline-separated `KEY=VALUE` lines) to the service manager, if there is one.
/// Failures are logged, never fatal: the daemon serves whether or not anyone listens.
pub fn notify(state: &str) {
    let Some(target) = std::env::var_os(NOTIFY_SOCKET) else {
        return;
    };
    let sent = address(&target).and_then(|addr| {
        let sock = UnixDatagram::unbound()?;
        sock.send_to_addr(state.as_bytes(), &addr)
    });
    if let Err(e) = sent {
        tracing::warn!(
            socket = %target.to_string_lossy(),
            "cannot notify the service manager ({state:?}): {e}"
        );
    }
}

fn address(target: &std::ffi::OsStr) -> std::io::Result<SocketAddr> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = target.as_bytes();
    match bytes.split_first() {
        Some((b'@', name)) => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(name)
        }
        Some((b'/', _)) => SocketAddr::from_pathname(std::path::Path::new(target)),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{NOTIFY_SOCKET}={} is neither a path nor an @abstract name",
                target.to_string_lossy()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_abstract_names_are_addresses_and_nothing_else_is() {
        use std::os::linux::net::SocketAddrExt;
        let a = address("@vramd-x".as_ref()).unwrap();
        assert_eq!(a.as_abstract_name(), Some(&b"vramd-x"[..]));
        let p = address("/run/systemd/notify".as_ref()).unwrap();
        assert_eq!(
            p.as_pathname(),
            Some(std::path::Path::new("/run/systemd/notify"))
        );
        assert!(address("relative".as_ref()).is_err());
        assert!(address("".as_ref()).is_err());
    }
}
