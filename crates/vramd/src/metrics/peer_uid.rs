//! Who is at the other end of a local TCP connection: the uid that owns the client's socket, from
//! the kernel's socket tables (`/proc/net/tcp`, `/proc/net/tcp6`). TCP carries no credentials;
//! on one host the kernel still knows whose socket connected.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The uid owning the socket at `peer` connected to our `port`, if `peer` is on this host and
/// the kernel's tables show that connection.
pub fn local_uid(peer: SocketAddr, port: u16) -> Option<u32> {
    if !peer.ip().is_loopback() && !is_mapped_loopback(peer.ip()) {
        return None;
    }
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            uid_in_table(&text, peer, port)
        })
}

fn is_mapped_loopback(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()))
}

/// The uid of the row whose local end is `peer` and whose remote port is `port`.
fn uid_in_table(text: &str, peer: SocketAddr, port: u16) -> Option<u32> {
    text.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (local, remote, uid) = (fields.get(1)?, fields.get(2)?, fields.get(7)?);
        let local = parse_endpoint(local)?;
        let (_, remote_port) = remote.rsplit_once(':')?;
        let same_peer = local.port() == peer.port() && same_ip(local.ip(), peer.ip());
        (same_peer && u16::from_str_radix(remote_port, 16).ok()? == port)
            .then(|| uid.parse().ok())?
    })
}

fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    let v4 = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    };
    v4(a) == v4(b)
}

/// `0100007F:1F90`: an address as the kernel prints it (each 32-bit word of it in hex, in the
/// host's byte order: one word for IPv4, four for IPv6), then the port in hex.
fn parse_endpoint(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| {
        let hex = ip.get(i * 8..i * 8 + 8)?;
        u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes)
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_table_names_the_uid_of_a_local_client() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().unwrap().port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (_conn, peer) = server.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        assert_eq!(
            local_uid(peer, port),
            Some(rustix::process::getuid().as_raw())
        );
        // Another port is another connection; a remote address is never looked up.
        assert_eq!(local_uid(peer, port.wrapping_add(1)), None);
        assert_eq!(local_uid("10.1.2.3:4000".parse().unwrap(), port), None);
    }

    #[test]
    fn both_address_forms_parse() {
        assert_eq!(
            parse_endpoint("0100007F:1F90"),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(
            parse_endpoint("00000000000000000000000001000000:0050"),
            Some("[::1]:80".parse().unwrap())
        );
    }
}
