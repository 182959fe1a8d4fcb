//! eldr-dataplane: the PD router's request path in Rust. A tokio/hyper server, started from
//! the PyO3 extension (as the SGLang gateway's is behind its Python `launch_router`), serves
//! /generate, /v1/completions and /v1/chat/completions with late binding (see [`flow`]) and
//! sends every other path to the Python control plane (admin endpoints, /metrics, /health).
//! It shares the core [`eldr_core::Router`] with Python: routing, the queue tracker, payload
//! decoding and hot reload (Python's reload thread swaps the centroids) are the core's.
//!
//! Modules: [`config`], [`server`] (accept loop), [`flow`] (the PD flow, one module per
//! stage: request → prefill → route → decode → pump), [`forward`] (every other path, to the
//! control plane), [`admission`] (the bound on requests in flight, its queue), [`upstream`]
//! (worker calls with timeouts), [`sse`] (the signature event), [`outlier`] (ejection),
//! [`counters`] (metrics), [`plane`] (shared state), [`reservoir`] (the refit reservoir's
//! keep/slot draw), [`experiment`] (the switchback experiment's arms, clock and blocks), [`response`] (response bodies), [`errors`].

pub mod admission;
pub mod config;
pub mod counters;
pub mod errors;
pub mod experiment;
pub mod flow;
pub mod forward;
pub mod outlier;
pub mod plane;
pub mod reservoir;
pub mod response;
pub mod server;
pub mod sse;
pub mod upstream;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use eldr_core::Router;
use tokio::runtime::Runtime;
use tokio::sync::watch;

pub use config::{Config, Role};
pub use config::ConfigError;
pub use plane::Plane;

/// A running (or not yet started) data plane.
pub struct DataPlane {
    plane: Arc<Plane>,
    runtime: Option<Runtime>,
    stop: Option<watch::Sender<bool>>,
    addr: Option<SocketAddr>,
}

impl DataPlane {
    pub fn new(cfg: Config, router: Arc<Router>) -> Result<Self, ConfigError> {
        Ok(DataPlane { plane: Arc::new(Plane::new(cfg, router)?), runtime: None, stop: None, addr: None })
    }

    pub fn plane(&self) -> &Arc<Plane> {
        &self.plane
    }

    /// Bind and serve on the data plane's own runtime threads; the bound port.
    pub fn start(&mut self) -> std::io::Result<u16> {
        if let Some(a) = self.addr {
            return Ok(a.port());
        }
        let cfg = &self.plane.cfg;
        let addr = (cfg.host.as_str(), cfg.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("cannot resolve {}", cfg.host)))?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(cfg.threads).thread_name("eldr-dataplane").enable_all().build()?;
        raise_fd_limit();
        let listener = {
            let _g = rt.enter();
            bind(addr)?
        };
        let bound = listener.local_addr()?;
        let (tx, rx) = watch::channel(false);
        rt.spawn(server::serve(listener, Arc::clone(&self.plane), rx));
        if let Some(x) = &self.plane.experiment {
            x.restart_clock();
            rt.spawn(experiment::run(Arc::clone(x)));
        }
        self.runtime = Some(rt);
        self.stop = Some(tx);
        self.addr = Some(bound);
        Ok(bound.port())
    }

    /// Stop accepting, and end the requests in flight (their guards release their slots).
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(true);
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(plane::SHUTDOWN_GRACE);
        }
        self.addr = None;
    }

    pub fn is_running(&self) -> bool {
        self.runtime.is_some()
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Pending connections the kernel holds for the accept loop (capped by net.core.somaxconn).
/// std's listeners ask for 128, which a burst of a few hundred new clients overflows: the
/// kernel then drops their handshakes and they see connect timeouts or resets.
const LISTEN_BACKLOG: u32 = 4096;

fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let sock = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    sock.set_reuseaddr(true)?;
    sock.bind(addr)?;
    sock.listen(LISTEN_BACKLOG)
}

/// Raise this process's open-file limit to its hard limit: each request in flight holds a
/// client socket and up to two worker sockets, and a soft limit of 1024 (a common default)
/// would fail connects and accepts (EMFILE) long before the admission bound is reached.
fn raise_fd_limit() {
    #[cfg(target_os = "linux")]
    // SAFETY: getrlimit/setrlimit only read and write the struct passed to them.
    unsafe {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) != 0 {
                eprintln!("eldr.dataplane WARNING could not raise the open-file limit from {}", lim.rlim_cur);
            }
        }
    }
}
