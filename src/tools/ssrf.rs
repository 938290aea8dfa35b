//! The SSRF guard's parts: which addresses are internal, and a DNS resolver that keeps only
//! public ones (for HTTP tools and for the client MCP servers are reached through).

use std::net::{IpAddr, SocketAddr};

/// `url`'s host as the guard compares it: lower case, an IPv6 literal without brackets
/// ("" when it has none).
pub fn host_of(url: &reqwest::Url) -> String {
    url.host_str()
        .unwrap_or("")
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase()
}

/// Loopback, link-local, private, unique-local, unspecified, multicast, broadcast,
/// benchmarking or reserved; IPv6 forms that carry an IPv4 address (mapped, compatible,
/// NAT64, 6to4) are judged by that address.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || a == 0
                // 100.64.0.0/10, carrier-grade NAT
                || (a == 100 && (b & 0xc0) == 64)
                // 198.18.0.0/15, benchmarking
                || (a == 198 && (b & 0xfe) == 18)
                // 240.0.0.0/4, reserved
                || a >= 240
        }
        IpAddr::V6(v6) => {
            let segments = v6.segments();
            let embedded = |hi: u16, lo: u16| {
                std::net::Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8)
            };
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_internal(IpAddr::V4(v4));
            }
            // ::a.b.c.d (IPv4-compatible, deprecated but still routed by some stacks).
            if segments[..6].iter().all(|s| *s == 0) && !v6.is_loopback() && !v6.is_unspecified() {
                return is_internal(IpAddr::V4(embedded(segments[6], segments[7])));
            }
            // 64:ff9b::/96, NAT64.
            if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return is_internal(IpAddr::V4(embedded(segments[6], segments[7])));
            }
            // 2002::/16, 6to4: the IPv4 address follows the prefix.
            if segments[0] == 0x2002 {
                return is_internal(IpAddr::V4(embedded(segments[1], segments[2])));
            }
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || v6.is_unique_local()
                || v6.is_unicast_link_local()
        }
    }
}

/// The public addresses `host` resolves to; an error when it resolves only to internal
/// ones.
async fn public_addrs(
    host: String,
) -> Result<Vec<SocketAddr>, Box<dyn std::error::Error + Send + Sync>> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
        .await?
        .filter(|a| !is_internal(a.ip()))
        .collect();
    if addrs.is_empty() {
        return Err(format!(
            "{host} resolves only to internal addresses (add it to tooling.allowed_private_hosts)"
        )
        .into());
    }
    Ok(addrs)
}

/// Resolves names and keeps only public addresses, so a tool cannot be pointed at the
/// internal network through DNS. For reqwest 0.12 (HTTP tools) and 0.13 (the client rmcp
/// speaks MCP through).
pub(crate) struct PublicOnlyResolver;

impl reqwest::dns::Resolve for PublicOnlyResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            Ok(Box::new(public_addrs(host).await?.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

impl reqwest_mcp::dns::Resolve for PublicOnlyResolver {
    fn resolve(&self, name: reqwest_mcp::dns::Name) -> reqwest_mcp::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            Ok(Box::new(public_addrs(host).await?.into_iter()) as reqwest_mcp::dns::Addrs)
        })
    }
}
