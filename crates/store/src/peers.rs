//! Who is on the other end of a connection: its address, the networks a
//! header is believed from (a trusted proxy's, the store's own sidecar's),
//! and the credential it has already shown.

use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::serve::IncomingStream;

/// Which credential a request presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presented {
    Api,
    Admin,
}

/// What a connection has shown so far: the first `Authorization` value that
/// matched a credential, which one, and which API tokens were accepted
/// then; and the peer's address (TCP only). Created per accepted connection
/// (`axum`'s connect info) and shared by its requests.
#[derive(Clone, Default)]
pub struct Connection {
    pub(crate) shown: Arc<OnceLock<Shown>>,
    pub(crate) peer: Option<IpAddr>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connection(***)")
    }
}

pub struct Shown {
    pub header: Box<[u8]>,
    pub presented: Presented,
    /// The API credential's generation it matched under: after a reload
    /// the value is checked again.
    pub generation: u64,
}

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for Connection {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> Connection {
        Connection {
            shown: Arc::default(),
            peer: Some(stream.remote_addr().ip()),
        }
    }
}

#[cfg(unix)]
impl Connected<IncomingStream<'_, tokio::net::UnixListener>> for Connection {
    fn connect_info(_: IncomingStream<'_, tokio::net::UnixListener>) -> Connection {
        Connection::default()
    }
}

/// An IPv4 or IPv6 network (`10.0.0.0/8`, `fd00::/8`), or one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl std::str::FromStr for Network {
    type Err = String;

    fn from_str(s: &str) -> Result<Network, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or network (write 10.0.0.5 or 10.0.0.0/24)"))?;
        let addr = addr.to_canonical();
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length must be 0 to {max}"))?,
        };
        Ok(Network { addr, prefix })
    }
}

impl Network {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let bits = |ip: IpAddr| -> u128 {
            match ip {
                IpAddr::V4(v4) => u128::from(u32::from(v4)),
                IpAddr::V6(v6) => u128::from(v6),
            }
        };
        let ip = ip.to_canonical();
        if ip.is_ipv4() != self.addr.is_ipv4() {
            return false;
        }
        let width: u32 = if ip.is_ipv4() { 32 } else { 128 };
        let host_bits = width - u32::from(self.prefix);
        let mask = u128::MAX.checked_shl(host_bits).unwrap_or(0);
        bits(ip) & mask == bits(self.addr) & mask
    }
}

/// The peer's address of the connection a request came on (none on a Unix
/// socket).
pub fn peer_of(extensions: &axum::http::Extensions) -> Option<IpAddr> {
    extensions.get::<ConnectInfo<Connection>>().and_then(|c| c.0.peer)
}

/// Whether `peer` is in one of `networks`.
pub fn trusted(networks: &[Network], peer: Option<IpAddr>) -> bool {
    peer.is_some_and(|ip| networks.iter().any(|n| n.contains(ip)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_contain_their_addresses_only() {
        let net: Network = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains("10.1.200.3".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.0.9".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let one: Network = "127.0.0.1".parse().unwrap();
        assert!(one.contains("127.0.0.1".parse().unwrap()));
        assert!(!one.contains("127.0.0.2".parse().unwrap()));
        let v6: Network = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        let all: Network = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.0.2.1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "nope", "10.0.0.0/x", "::/129"] {
            assert!(bad.parse::<Network>().is_err(), "{bad}");
        }
    }
}
