//! The work primitives of an execution context: kernel launches and graph
//! replays, each enqueued on the local stream or recorded
//! by the remote backend.

use cuda_core::cudarc::driver::LaunchConfig;
use cuda_core::{Error, Kernel, Result};

use super::ExecutionContext;
use crate::launch::{check_launch_config, KernelArgs};
use crate::remote::RemoteGraph;

/// A graph to replay, where it lives.
pub(crate) enum GraphRef<'a> {
    Local(&'a std::sync::Mutex<cuda_core::graph::TrackedGraph>),
    Remote(&'a RemoteGraph),
}

impl ExecutionContext {
    /// Launches `kernel` with `args`, ordered after the uses its buffer
    /// arguments conflict with and recorded as a use of each.
    pub(crate) fn launch<A: KernelArgs>(
        &mut self,
        kernel: &Kernel,
        config: LaunchConfig,
        args: &mut A,
    ) -> Result<()> {
        check_launch_config(&config)?;
        if let Some(r) = self.as_remote() {
            return r.launch(kernel, &config, args);
        }
        // Resolved for the context's device: compiled or loaded there on
        // first use (process-wide cache), two atomic loads afterwards. Its
        // module stays loaded for the life of the process.
        let func = kernel.function_on(self.device()?)?;
        args.check(kernel)?;
        let stream = self.cuda_stream()?.clone();
        args.before_all(&stream)?;
        let launched = {
            let mut b = stream.launch_builder(func);
            args.push_all(&mut b);
            // SAFETY: argument count and sizes match the kernel's PTX
            // parameters (checked above), so the driver reads valid argument
            // memory; buffers stay alive until the GPU is done (owned ones in
            // the op's output, borrowed ones for the op's lifetime, and every
            // free is ordered after the uses recorded below); the kernel's
            // own memory safety is the `launch` caller's contract.
            unsafe { b.launch(config) }.map_err(|e| Error::driver("cuLaunchKernel", e))
        };
        // cudarc can fail after `cuLaunchKernel` enqueued the kernel (its
        // event records come after), so record the uses either way; a
        // buffer whose use cannot be recorded leaks instead of freeing early.
        // One event after the launch marks every buffer's use.
        let recorded = args.after_all(&self.mark(&stream));
        launched?;
        recorded
    }

    /// Replays `graph`, ordered against every other use of its buffers;
    /// `home` names where it lives, for an error only (a replay formats
    /// nothing).
    pub(crate) fn launch_graph(
        &mut self,
        graph: GraphRef<'_>,
        home: impl FnOnce() -> String,
    ) -> Result<()> {
        let wrong = |context: &str| Error::WrongHome {
            buffer: format!("a graph of {}", home()),
            context: context.into(),
        };
        match (self.as_remote(), graph) {
            (Some(r), GraphRef::Remote(g)) => {
                if g.record_launch(r) {
                    Ok(())
                } else {
                    Err(wrong(&r.describe()))
                }
            }
            (Some(r), GraphRef::Local(_)) => Err(wrong(&r.describe())),
            (None, GraphRef::Remote(_)) => Err(wrong(&self.describe())),
            (None, GraphRef::Local(g)) => {
                let stream = self.cuda_stream_for("a CUDA graph replay")?;
                // Ordered against the buffers' other uses, and recorded as a
                // use of each; what the graph keeps is released after its
                // last replay.
                g.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .launch_on(stream)
            }
        }
    }
}
