//! Which `Host` header values a server answers. A page on any web site can make the browser send
//! requests to `http://127.0.0.1:8686`, but cannot read the answers (same-origin policy) — unless it
//! rebinds its own name: `evil.example` first resolves to the attacker's server, then to 127.0.0.1,
//! and the browser then sends `Host: evil.example:8686` to the dashboard and lets the page read
//! every run (or use the model server). Answering only the names this machine calls itself closes
//! that door.

use std::net::IpAddr;

/// Names accepted by default, with any port.
const DEFAULT_NAMES: [&str; 1] = ["localhost"];
/// Addresses accepted by default, with any port (`127.0.0.1` and `[::1]`).
const DEFAULT_IPS: [IpAddr; 2] = [IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)];

/// The accepted `Host` values: localhost, 127.0.0.1 and [::1], the address a connection came in on
/// (the one `--host` names, or the machine's address when listening on all of them), and names
/// added with `--allow-host`. An IP literal is safe to accept: rebinding needs a name.
#[derive(Debug, Clone)]
pub(crate) struct AllowedHosts {
    names: Vec<String>,
    ips: Vec<IpAddr>,
}

impl Default for AllowedHosts {
    fn default() -> Self {
        Self { names: DEFAULT_NAMES.iter().map(|s| s.to_string()).collect(), ips: DEFAULT_IPS.to_vec() }
    }
}

impl AllowedHosts {
    /// The defaults and `extra` (names or addresses, with or without a port or brackets).
    pub(crate) fn new<S: AsRef<str>>(extra: impl IntoIterator<Item = S>) -> Self {
        let mut out = Self::default();
        for e in extra {
            let e = e.as_ref().trim();
            let name = split_host(e).unwrap_or(e);
            match parse_ip(name) {
                Some(ip) => out.ips.push(ip),
                None if !name.is_empty() => out.names.push(name.to_ascii_lowercase()),
                None => {}
            }
        }
        out
    }

    /// Whether a request whose `Host` is `host` (the header value, port included) and that arrived on
    /// the local address `local` is answered.
    pub(crate) fn allows(&self, host: &str, local: Option<IpAddr>) -> bool {
        let Some(name) = split_host(host) else { return false };
        match parse_ip(name) {
            Some(ip) => {
                let ip = canonical(ip);
                self.ips.iter().any(|&a| canonical(a) == ip) || local.is_some_and(|l| canonical(l) == ip)
            }
            None => self.names.iter().any(|n| n.eq_ignore_ascii_case(name)),
        }
    }
}

/// An IPv4 address carried as IPv6 (`::ffff:127.0.0.1`) compares as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// `127.0.0.1` or `[::1]` (brackets required around IPv6 in a Host header) as an address.
fn parse_ip(name: &str) -> Option<IpAddr> {
    match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().ok().map(IpAddr::V6),
        None => name.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4),
    }
}

/// The host part of a `Host` value (`name[:port]`, `[v6][:port]`); `None` when malformed (a bare
/// IPv6 address, a port that is not a number, whitespace, an empty name).
fn split_host(value: &str) -> Option<&str> {
    let (name, port) = if value.starts_with('[') {
        let end = value.find(']')?;
        let (name, rest) = value.split_at(end + 1);
        match rest {
            "" => (name, None),
            r => (name, Some(r.strip_prefix(':')?)),
        }
    } else {
        match value.split_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (value, None),
        }
    };
    let port_ok = port.is_none_or(|p| p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
    let name_ok = !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'[' | b']' | b':'));
    (port_ok && name_ok).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_are_answered_with_any_port() {
        let h = AllowedHosts::default();
        for ok in [
            "localhost",
            "localhost:8686",
            "LocalHost:1",
            "127.0.0.1",
            "127.0.0.1:8686",
            "[::1]",
            "[::1]:8686",
            "[0:0:0:0:0:0:0:1]:80",
            "[::ffff:127.0.0.1]:8686",
            "localhost:",
        ] {
            assert!(h.allows(ok, None), "{ok}");
        }
    }

    #[test]
    fn other_names_are_refused() {
        let h = AllowedHosts::default();
        for bad in [
            "evil.example",
            "evil.example:8686",
            "localhost.evil.example",
            "localhost.",
            "127.0.0.1.nip.io",
            "127.0.0.2",
            "10.0.0.1:8686",
            "::1",
            "[::1",
            "[::1]x",
            "[::1]:port",
            "localhost:8686:1",
            "localhost:123456",
            "local host",
            "",
            ":8686",
            "[]:1",
            "user@localhost",
        ] {
            assert!(!h.allows(bad, None), "{bad}");
        }
    }

    #[test]
    fn the_listening_address_and_added_names_are_answered() {
        let h = AllowedHosts::new(["Box.Lan", "192.168.1.5:8686", "[fe80::1]", ""]);
        assert!(h.allows("box.lan:8686", None));
        assert!(h.allows("192.168.1.5", None));
        assert!(h.allows("[fe80::1]:1", None));
        assert!(!h.allows("other.lan", None));
        assert!(!h.allows("192.168.1.6", None));
        // `--host 0.0.0.0`: the address the client reached; never a name.
        let local: IpAddr = "10.1.2.3".parse().unwrap();
        assert!(AllowedHosts::default().allows("10.1.2.3:8686", Some(local)));
        assert!(!AllowedHosts::default().allows("10.1.2.4:8686", Some(local)));
        assert!(!AllowedHosts::default().allows("evil.example", Some(local)));
    }
}
