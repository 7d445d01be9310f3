//! The wire protocol ([`cuda_lease_proto`], re-exported here) and its
//! async frame I/O over tokio streams.
//!
//! Lengths are checked against the [`Limits`] before anything is
//! allocated. A read fails with `io::ErrorKind::InvalidData` wrapping a
//! [`ProtoError`] for a bad frame, and other I/O errors as they come. No
//! function here is cancel safe: a dropped read or write leaves the stream
//! mid-frame.

pub use cuda_lease_proto::*;

/// Reads one frame from an async stream.
pub async fn read_frame<R>(r: &mut R, limits: &Limits) -> std::io::Result<Frame>
where
    R: tokio::io::AsyncRead + Unpin + ?Sized,
{
    use tokio::io::AsyncReadExt;
    let (header, body) = read_head(r, limits).await?;
    let mut data = vec![0u8; header.data_len as usize];
    r.read_exact(&mut data).await?;
    Ok(Frame { header, body, data })
}

/// Reads a frame's header and body, leaving its data in the stream (for
/// readers that stream the data on).
pub async fn read_head<R>(r: &mut R, limits: &Limits) -> std::io::Result<(Header, Vec<u8>)>
where
    R: tokio::io::AsyncRead + Unpin + ?Sized,
{
    use tokio::io::AsyncReadExt;
    let header = read_header(r, limits).await?;
    let mut body = vec![0u8; header.body_len as usize];
    r.read_exact(&mut body).await?;
    Ok((header, body))
}

/// Reads a frame's fixed header alone.
pub async fn read_header<R>(r: &mut R, limits: &Limits) -> std::io::Result<Header>
where
    R: tokio::io::AsyncRead + Unpin + ?Sized,
{
    use tokio::io::AsyncReadExt;
    let mut hb = [0u8; HEADER_LEN];
    r.read_exact(&mut hb).await?;
    Header::decode(&hb, limits).map_err(invalid_data)
}

/// Writes one frame to an async stream without joining its parts.
pub async fn write_frame<W>(
    w: &mut W,
    header: &Header,
    body: &[u8],
    data: &[u8],
) -> std::io::Result<()>
where
    W: tokio::io::AsyncWrite + Unpin + ?Sized,
{
    write_frame_parts(w, header, body, &[data]).await
}

/// [`write_frame`] with the data in parts, written back to back (never
/// joined in memory unless the whole frame is small).
pub async fn write_frame_parts<W>(
    w: &mut W,
    header: &Header,
    body: &[u8],
    parts: &[&[u8]],
) -> std::io::Result<()>
where
    W: tokio::io::AsyncWrite + Unpin + ?Sized,
{
    use tokio::io::AsyncWriteExt;
    let head = header.encode();
    let len = head.len() + body.len() + parts.iter().map(|p| p.len()).sum::<usize>();
    if len <= SMALL_FRAME {
        // One write: on a QUIC stream each write takes the connection's
        // lock and wakes its driver, which may send what it has so far as
        // a packet of its own (a header alone, then the body...); on a
        // worker's pipe the reader wakes to a whole frame.
        let mut frame = Vec::with_capacity(len);
        frame.extend_from_slice(&head);
        frame.extend_from_slice(body);
        for p in parts {
            frame.extend_from_slice(p);
        }
        w.write_all(&frame).await?;
    } else {
        w.write_all(&head).await?;
        w.write_all(body).await?;
        for p in parts {
            w.write_all(p).await?;
        }
    }
    w.flush().await
}
