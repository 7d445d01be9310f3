//! A real etcd for the fleet tests, and helpers to follow it.
//!
//! Needs an `etcd` binary (Debian's `etcd-server`; `.ci/run` installs it):
//! `$CUDA_LEASE_TEST_ETCD`, else `etcd` on the `PATH`. Each test starts its
//! own etcd on free loopback ports with a temporary data directory, and
//! stops it by its PID when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cuda_lease::client::ClientConfig;
use cuda_lease_fleet::{Fleet, FleetConfig, NodeRecord, RegistryConfig};

use super::TOKEN;

/// Longest a registry change may take to reach a client here.
pub const PROMPT: Duration = Duration::from_secs(5);

/// An etcd server of this test: its own ports and data directory.
pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

pub fn etcd_binary() -> PathBuf {
    std::env::var_os("CUDA_LEASE_TEST_ETCD")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join("etcd"))
                    .find(|p| p.is_file())
            })
        })
        .expect("no etcd binary: install Debian's etcd-server (apt-get install etcd-server) or set CUDA_LEASE_TEST_ETCD")
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub async fn start() -> Etcd {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "cuda-lease-fleet-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut e = Etcd {
            child: None,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
        };
        // A port [`free_port`] found free can be taken again before etcd
        // binds it (by a connection's own port, say): etcd then exits, and
        // starts again on others.
        for _ in 0..4 {
            if e.run().await {
                return e;
            }
            e.client_port = free_port();
            e.peer_port = free_port();
        }
        panic!("etcd exited at each of 4 starts:\n{}", e.log());
    }

    /// The tail of etcd's log (its directory goes with it).
    fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(10).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// A fleet client's configuration for this etcd: trusting the
    /// registry's fingerprints, with the test token.
    pub fn fleet_config(&self) -> FleetConfig {
        let mut cfg = FleetConfig::new([self.url()])
            .trust_registry(true)
            .client(ClientConfig::pinned_sha256([0; 32]).token(TOKEN));
        cfg.connect_timeout = Duration::from_millis(500);
        cfg
    }

    /// Starts the process on this server's ports and data directory and
    /// waits until it answers (true) or exits (false).
    async fn run(&mut self) -> bool {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.join("etcd.log")).unwrap();
        let child = Command::new(etcd_binary())
            .args(["--name", "fleet-test"])
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &self.url()])
            .args(["--advertise-client-urls", &self.url()])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("fleet-test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            // Answers once a fleet client can read the registry.
            if Fleet::connect(self.fleet_config()).await.is_ok() {
                return true;
            }
            if let Some(c) = self.child.as_mut() {
                if c.try_wait().is_ok_and(|s| s.is_some()) {
                    self.child = None;
                    return false;
                }
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not answer within 15 s; its log ends:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops etcd and starts it again on the same ports with an empty data
    /// directory (every record and etcd lease gone: nodes must register
    /// again).
    pub async fn restart_empty(&mut self) {
        self.kill();
        std::fs::remove_dir_all(self.dir.join("data")).unwrap();
        // On the same ports: the nodes and clients know them.
        assert!(
            self.run().await,
            "etcd exited on its restart:\n{}",
            self.log()
        );
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How a test node registers in `etcd`: records written at most every
/// 50 ms, TTL `ttl`.
pub fn registry(etcd: &Etcd, ttl: Duration) -> RegistryConfig {
    let mut r = RegistryConfig::new([etcd.url()]);
    r.ttl = ttl;
    r.min_update_interval = Duration::from_millis(50);
    r
}

/// A client of the fleet in `etcd`, trusting the registry's fingerprints,
/// with the test token ([`follow_with`]).
pub async fn follow(etcd: &Etcd) -> Fleet {
    follow_with(etcd.fleet_config()).await
}

/// A client of the fleet as `cfg` says. Connecting is tried again for up
/// to 20 s: each try has the test configuration's short etcd timeout,
/// which a loaded machine can miss.
pub async fn follow_with(cfg: FleetConfig) -> Fleet {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match Fleet::connect(cfg.clone()).await {
            Ok(fleet) => return fleet,
            Err(e) if Instant::now() < deadline => {
                eprintln!("following the fleet failed ({e}); trying again");
            }
            Err(e) => panic!("follow the fleet: {e}"),
        }
    }
}

/// Waits until the fleet's view satisfies `pred`; panics naming `what`.
pub async fn until(fleet: &Fleet, what: &str, pred: impl FnMut(&[NodeRecord]) -> bool) {
    assert!(
        fleet.wait_until(PROMPT, pred).await,
        "waited {PROMPT:?} for {what}; the fleet shows {:?}",
        fleet.nodes()
    );
}
