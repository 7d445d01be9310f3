//! What one forward pass costs the host, piece by piece: the model's
//! pipeline and its parts as ops, awaited one at a time and 64 at once on
//! one thread, beside the baseline's cudarc calls. A measuring tool for
//! the service's local path (GPU 0); prints one line a case.
//!
//! ```text
//! cargo run --release -p cuda-async-service --example forward_cost
//! ```

use std::sync::Arc;
use std::time::Instant;

use cuda_async::blas::{gemm, Gemm};
use cuda_async::prelude::*;
use cuda_async::{Device, SubmitThread};
use cuda_async_service::baseline::Baseline;
use cuda_async_service::model::{random, HostWeights, Model, D_IN, HIDDEN};

const N: usize = 3000;

fn line(name: &str, t: Instant, n: usize) {
    println!(
        "{name:<44} {:>8.2} us",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
}

async fn one_at_a_time<F, Fut>(name: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for _ in 0..200 {
        f().await;
    }
    let t = Instant::now();
    for _ in 0..N {
        f().await;
    }
    line(name, t, N);
}

/// 64 tasks, each running `N / 64` forward passes as the service does
/// (timed, downloaded, copied out): the time a request.
async fn in_flight(
    name: &str,
    model: &Arc<Model>,
    pool: &Arc<dyn SchedulingPolicy>,
    submit: Option<Arc<SubmitThread>>,
    x: &[f32],
) {
    let plain = name.contains("plain");
    let t = Instant::now();
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (model, pool, x, submit) =
                (model.clone(), pool.clone(), x.to_vec(), submit.clone());
            tokio::spawn(async move {
                for _ in 0..N / 64 {
                    if plain {
                        let op = model.forward(x.clone(), 1).schedule(&*pool).unwrap();
                        match &submit {
                            Some(s) => drop(s.enqueue(op).await.unwrap()),
                            None => drop(op.await.unwrap()),
                        }
                        continue;
                    }
                    let op = model
                        .forward(x.clone(), 1)
                        .timed()
                        .schedule(&*pool)
                        .unwrap();
                    let (out, t) = match &submit {
                        Some(s) => s.enqueue(op).await.unwrap(),
                        None => op.await.unwrap(),
                    };
                    let _ = t.elapsed();
                    out.to_vec().unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    line(name, t, N / 64 * 64);
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let weights = HostWeights::random(1);
    let x = random(D_IN, 9, 1.0);
    let base = Baseline::new(&weights)?;
    let t = Instant::now();
    for _ in 0..N {
        base.forward(&x, 1)?;
    }
    line("baseline forward (cudarc, sync)", t, N);
    let threads = 16;
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..N / threads {
                    base.forward(&x, 1).unwrap();
                }
            });
        }
    });
    line("baseline forward, 16 threads (per request)", t, N);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let pool: Arc<dyn SchedulingPolicy> =
            Arc::new(StreamPoolRoundRobin::new(&Device::new(0)?, 4)?);
        let model = Arc::new(Model::upload(&weights, &*pool).await?);
        let p = &*pool;
        one_at_a_time("ops forward", || async {
            model
                .forward(x.clone(), 1)
                .schedule(p)
                .unwrap()
                .await
                .unwrap();
        })
        .await;
        one_at_a_time("ops forward .timed() + to_vec", || async {
            let (out, _t) = model
                .forward(x.clone(), 1)
                .timed()
                .schedule(p)
                .unwrap()
                .await
                .unwrap();
            out.to_vec().unwrap();
        })
        .await;
        one_at_a_time("ops h2d then d2h (512 f32)", || async {
            h2d(x.clone()).then(d2h).schedule(p).unwrap().await.unwrap();
        })
        .await;
        one_at_a_time("ops zeros (256 f32)", || async {
            zeros::<f32>(HIDDEN).schedule(p).unwrap().await.unwrap();
        })
        .await;
        let w1 = Arc::new(h2d(weights.w1.clone()).schedule(p)?.await?);
        let xb = Arc::new(h2d(x.clone()).schedule(p)?.await?);
        let mut hid = Some(zeros::<f32>(HIDDEN).schedule(p)?.await?);
        for (name, k) in [("ops one gemm 256x1x512", 1), ("ops 10 gemms chained", 10)] {
            // `k` products chained on the same output, after 200 warm-up runs.
            let mut t = Instant::now();
            for i in 0..200 + N {
                if i == 200 {
                    t = Instant::now();
                }
                let h = hid.take().unwrap();
                let mut op = gemm(Gemm::new(HIDDEN, 1, D_IN), w1.clone(), xb.clone(), h).boxed();
                for _ in 1..k {
                    let (w, xx) = (w1.clone(), xb.clone());
                    op = op
                        .then(move |(_, _, h)| gemm(Gemm::new(HIDDEN, 1, D_IN), w, xx, h))
                        .boxed();
                }
                hid = Some(op.schedule(p)?.await?.2);
            }
            line(name, t, N);
        }
        // 64 requests in flight on this one thread: the host's cost a
        // request when the GPU is kept busy.
        in_flight(
            "ops forward .timed(), 64 tasks, 1 thread",
            &model,
            &pool,
            None,
            &x,
        )
        .await;
        Ok::<(), cuda_async::Error>(())
    })?;
    drop(rt);
    // The same on 16 runtime threads, each task enqueuing its own, or all
    // of them through one submit thread.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(16)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let pool: Arc<dyn SchedulingPolicy> =
            Arc::new(StreamPoolRoundRobin::new(&Device::new(0)?, 4)?);
        let model = Arc::new(Model::upload(&weights, &*pool).await?);
        in_flight(
            "ops forward .timed(), 64 tasks, 16 threads",
            &model,
            &pool,
            None,
            &x,
        )
        .await;
        let submit = Some(Arc::new(SubmitThread::new()?));
        in_flight(
            "  the same through a SubmitThread",
            &model,
            &pool,
            submit.clone(),
            &x,
        )
        .await;
        in_flight(
            "ops forward plain, 64 tasks, 16 threads",
            &model,
            &pool,
            None,
            &x,
        )
        .await;
        in_flight("  plain, through a SubmitThread", &model, &pool, submit, &x).await;
        Ok::<(), cuda_async::Error>(())
    })?;
    Ok(())
}
