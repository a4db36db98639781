//! The tenant `vramd run` registers before it starts the program: every problem with the
//! tenant (no daemon, an unknown class, a guarantee that cannot be met, a name in use) is then a
//! clear error before the program runs, and the tenant shows in `vramd status` from the start,
//! whether or not the program ever allocates. The program's libvram.so joins the registration
//! with the invitation's token (`Role::Join`); when the program ends, its memory is reclaimed,
//! and this connection tells the daemon how it ended before it closes.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vram_core::Bytes;
use vram_proto::{Conn, ExitStatus, Hello, Reply, Request, Role, Welcome};

/// What the tenant asks to be admitted as.
pub struct Ask {
    pub name: String,
    pub class: Option<String>,
    pub guarantee: Option<Bytes>,
    pub limit: Option<Bytes>,
    pub gpu: Option<u32>,
}

/// A registered tenant and its invitation.
pub struct Registration {
    conn: Conn,
    welcome: Welcome,
    token: String,
}

impl Registration {
    /// Registers `ask` with the daemon at `socket` and takes an invitation for the program.
    pub fn register(socket: &Path, ask: Ask) -> anyhow::Result<Registration> {
        let stream = UnixStream::connect(socket).with_context(|| {
            format!(
                "cannot reach vramd at {} (is `vramd serve` running? --socket or VRAMD_SOCKET \
                 names its socket)",
                socket.display()
            )
        })?;
        let conn = Conn::new(stream);
        let hello = Hello {
            role: Role::Tenant {
                name: ask.name.clone(),
                class: ask.class,
                guarantee: ask.guarantee,
                limit: ask.limit,
            },
            gpu: ask.gpu,
            client: format!("vramd run {}", env!("CARGO_PKG_VERSION")),
            resume: None,
        };
        let welcome = match call(&conn, 1, &Request::Hello(hello), ANSWER_WITHIN)? {
            Reply::Welcome(w) => w,
            Reply::Error(e) => bail!("vramd refused tenant `{}`: {}", ask.name, e.message),
            other => bail!("vramd answered the registration with {other:?}"),
        };
        let token = match call(&conn, 2, &Request::Invite, ANSWER_WITHIN)? {
            Reply::Invitation { token } => token,
            Reply::Error(e) => bail!("vramd refused an invitation: {}", e.message),
            other => bail!("vramd answered the invitation with {other:?}"),
        };
        Ok(Registration {
            conn,
            welcome,
            token,
        })
    }

    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// What the program's libvram.so joins with.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Tells the daemon how the program ended, then closes the registration.
    pub fn exited(self, status: ExitStatus) {
        // The daemon may have restarted meanwhile; the program's end is then its own news. Told
        // in passing: a daemon that does not answer soon does not hold up the exit status.
        let _ = call(&self.conn, 3, &Request::Exited(status), EXIT_ANSWER_WITHIN);
        let _ = self.conn.stream().shutdown(std::net::Shutdown::Both);
    }
}

/// How long the daemon may take to answer the registration's requests.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);
/// How long the program's end waits for the daemon to take note of it.
const EXIT_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Sends `request` and waits for its answer: a daemon that accepted but does not answer within
/// `within` (stopped, wedged) is an error, not a wait without end.
fn call(conn: &Conn, id: u64, request: &Request, within: Duration) -> anyhow::Result<Reply> {
    conn.send(id, request, &[])
        .context("cannot talk to vramd")?;
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("vramd did not answer within {} s", within.as_secs());
        }
        let r = conn
            .recv_within::<Reply>(Some(left))
            .context("vramd did not answer, or closed the connection")?;
        if r.id == id {
            return Ok(r.msg);
        }
        // Anything unasked (a reclaim request, while this connection holds no memory) is not
        // this registration's to answer.
    }
}
