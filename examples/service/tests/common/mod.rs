//! What the service's tests share: the binary started on 127.0.0.1 and a
//! plain HTTP/1.1 client.
#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cuda_async_service::model::D_IN;

/// The service binary: beside this test's executable (a GPU bundle), or
/// where cargo built it.
pub fn service_exe() -> PathBuf {
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            let cand = dir.join("service");
            if cand.is_file() {
                return cand;
            }
        }
    }
    PathBuf::from(env!("CARGO_BIN_EXE_service"))
}

/// The service binary, running.
pub struct Running {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Running {
    /// On an embedded node with the in-memory device.
    pub fn start(extra: &[&str]) -> Running {
        let mut args = vec!["--lease", "embedded", "--embedded-device", "memory"];
        args.extend_from_slice(extra);
        Running::with(&args)
    }

    /// With `args` (and `--listen 127.0.0.1:0 --streams 2`).
    pub fn with(args: &[&str]) -> Running {
        let mut child = Command::new(service_exe())
            .args(["--listen", "127.0.0.1:0", "--streams", "2"])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("the service starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("first line: {line:?}"))
            .parse()
            .unwrap();
        Running { child, addr }
    }

    pub fn stop(mut self) -> std::process::ExitStatus {
        sigterm(&self.child);
        self.child.wait().unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn sigterm(child: &Child) {
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -TERM");
}

/// The head of an HTTP/1.1 request with `body`'s length.
pub fn head(method: &str, path: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: {content_type}\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes()
}

/// The status and body of the response read to its end from `s`.
pub fn response(mut s: TcpStream) -> (u16, Vec<u8>) {
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let split = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let head = String::from_utf8_lossy(&all[..split]).to_string();
    let status = head[9..12].parse().unwrap();
    (status, all[split + 4..].to_vec())
}

/// One request on a fresh connection.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    ct: &str,
    body: &[u8],
) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(&head(method, path, ct, body)).unwrap();
    s.write_all(body).unwrap();
    response(s)
}

/// `POST /infer` of the samples `x`, binary: the status and the body's
/// `f32`s (none unless 200).
pub fn infer_binary(addr: SocketAddr, x: &[f32]) -> (u16, Vec<f32>, Vec<u8>) {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let (status, body) = request(addr, "POST", "/infer", "application/octet-stream", &bytes);
    let floats = if status == 200 {
        body.chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    } else {
        Vec::new()
    };
    (status, floats, body)
}

pub fn json_body(x: &[f32]) -> Vec<u8> {
    let rows: Vec<&[f32]> = x.chunks(D_IN).collect();
    serde_json::to_vec(&serde_json::json!({ "inputs": rows })).unwrap()
}

pub fn assert_close(got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(*g) - w).abs() / w.abs().max(1e-6);
        assert!(err < 1e-3, "output {i}: {g} against {w}");
    }
}
