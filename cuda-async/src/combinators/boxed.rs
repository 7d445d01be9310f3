//! [`Boxed`]: a type-erased op kept as a flat list of steps.
//!
//! A chain built in a loop (`op = op.then(f).boxed()`) appends a step to
//! the list instead of nesting one box in the next: its steps live one
//! after another in one buffer (no allocation a step once it has grown),
//! run in a loop (no recursion, so no depth limit) and hand each other
//! their values through one slot.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::mem::{align_of, size_of, MaybeUninit};

use cuda_core::Result;

use crate::context::ExecutionContext;
use crate::op::{impl_into_future, DeviceOp};

/// The alignment of the step buffer and the value slot; a type aligned
/// more than this is kept boxed.
const ALIGN: usize = 16;

/// Bytes of a value kept in the slot in place; a larger one is boxed.
/// Three owned buffers fit (a library op's output), so a chain of steps
/// that hand buffers on allocates nothing between them.
const SLOT_BYTES: usize = 256;
const _: () = assert!(3 * size_of::<crate::DeviceBuffer<f32>>() <= SLOT_BYTES);

/// One aligned unit of the step buffer and the slot.
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Chunk(MaybeUninit<[u8; ALIGN]>);

const UNINIT: Chunk = Chunk(MaybeUninit::uninit());

/// Whether a `V` is kept in place in a space of `max` bytes (else boxed,
/// the space holding the box's pointer).
const fn in_place<V>(max: usize) -> bool {
    size_of::<V>() <= max && align_of::<V>() <= ALIGN
}

/// Chunks a `V` takes in the step buffer.
const fn chunks<V>() -> usize {
    let bytes = if in_place::<V>(usize::MAX) {
        size_of::<V>()
    } else {
        size_of::<Box<V>>()
    };
    bytes.div_ceil(ALIGN)
}

/// Moves `v` into the space at `p`.
///
/// # Safety
/// `p` is aligned to [`ALIGN`], with `max` bytes (and at least a pointer's)
/// writable and holding no value.
unsafe fn store<V>(p: *mut Chunk, max: usize, v: V) {
    if in_place::<V>(max) {
        // SAFETY: `V` fits in `max` bytes at `p` and needs no more than
        // its alignment (the caller's contract).
        unsafe { p.cast::<V>().write(v) }
    } else {
        // SAFETY: a pointer fits there (the caller's contract).
        unsafe { p.cast::<*mut V>().write(Box::into_raw(Box::new(v))) }
    }
}

/// Moves the `V` out of the space at `p`, which then holds no value.
///
/// # Safety
/// The space holds a `V` that [`store`] put there with the same `max`.
unsafe fn load<V>(p: *mut Chunk, max: usize) -> V {
    if in_place::<V>(max) {
        // SAFETY: a `V` stored in place (the caller's contract).
        unsafe { p.cast::<V>().read() }
    } else {
        // SAFETY: the pointer of a box `store` made (the caller's contract).
        unsafe { *Box::from_raw(p.cast::<*mut V>().read()) }
    }
}

/// The value between two steps: the output of the one before, the input
/// of the next.
struct Slot([Chunk; SLOT_BYTES / ALIGN]);

impl Slot {
    /// # Safety
    /// The slot holds no value.
    unsafe fn put<V>(&mut self, v: V) {
        // SAFETY: `SLOT_BYTES` aligned bytes holding no value.
        unsafe { store(self.0.as_mut_ptr(), SLOT_BYTES, v) }
    }

    /// # Safety
    /// The slot holds a `V` that [`Slot::put`] put there.
    unsafe fn take<V>(&mut self) -> V {
        // SAFETY: the caller's contract.
        unsafe { load(self.0.as_mut_ptr(), SLOT_BYTES) }
    }
}

/// Runs the step stored at its pointer (taking it), reading its input from
/// the slot and leaving its output there.
type Run = unsafe fn(*mut Chunk, &mut Slot, &mut ExecutionContext) -> Result<()>;

/// A step: where it is in the buffer, how to run it, how to drop it unrun.
#[derive(Clone, Copy)]
struct Step {
    at: usize,
    run: Run,
    drop: unsafe fn(*mut Chunk),
}

/// Drops the `V` stored at `p`.
///
/// # Safety
/// As [`load`], with `max` unbounded.
unsafe fn drop_step<V>(p: *mut Chunk) {
    // SAFETY: forwarded.
    drop(unsafe { load::<V>(p, usize::MAX) });
}

/// Runs op `O` (the first step).
///
/// # Safety
/// `p` holds an `O`; the slot holds no value; the context contract of
/// [`DeviceOp::execute`].
unsafe fn run_op<O: DeviceOp>(
    p: *mut Chunk,
    slot: &mut Slot,
    ctx: &mut ExecutionContext,
) -> Result<()> {
    // SAFETY: `p` holds an `O` (the caller's contract).
    let op = unsafe { load::<O>(p, usize::MAX) };
    // SAFETY: the context contract is the caller's.
    let out = unsafe { op.execute(ctx) }?;
    // SAFETY: the slot holds no value (the caller's contract).
    unsafe { slot.put(out) };
    Ok(())
}

/// Runs `f` on the slot's `A` and then the op it returns.
///
/// # Safety
/// `p` holds an `F`; the slot holds an `A`; the context contract of
/// [`DeviceOp::execute`].
unsafe fn run_then<A, B, F>(
    p: *mut Chunk,
    slot: &mut Slot,
    ctx: &mut ExecutionContext,
) -> Result<()>
where
    B: DeviceOp,
    F: FnOnce(A) -> B,
{
    // SAFETY: `p` holds an `F` (the caller's contract).
    let f = unsafe { load::<F>(p, usize::MAX) };
    // SAFETY: the slot holds an `A` (the caller's contract).
    let a = unsafe { slot.take::<A>() };
    // SAFETY: the context contract is the caller's.
    let out = unsafe { f(a).execute(ctx) }?;
    // SAFETY: `take` left the slot holding no value.
    unsafe { slot.put(out) };
    Ok(())
}

/// Runs `f` on the slot's `A`.
///
/// # Safety
/// `p` holds an `F`; the slot holds an `A`.
unsafe fn run_map<A, U, F>(
    p: *mut Chunk,
    slot: &mut Slot,
    _ctx: &mut ExecutionContext,
) -> Result<()>
where
    F: FnOnce(A) -> U,
{
    // SAFETY: `p` holds an `F` (the caller's contract).
    let f = unsafe { load::<F>(p, usize::MAX) };
    // SAFETY: the slot holds an `A` (the caller's contract).
    let a = unsafe { slot.take::<A>() };
    // SAFETY: `take` left the slot holding no value.
    unsafe { slot.put(f(a)) };
    Ok(())
}

/// The steps of a [`Boxed`], in one buffer; those not yet run are dropped
/// with it.
struct Steps {
    buf: Vec<Chunk>,
    steps: Vec<Step>,
    /// The first step not yet taken.
    next: usize,
}

impl Steps {
    /// Appends `v`, run by `run`.
    ///
    /// # Safety
    /// `run` reads a `V` at its pointer; it and the steps before it hand
    /// each other values of the types they read and write.
    unsafe fn push<V: Send>(&mut self, v: V, run: Run) {
        let at = self.buf.len();
        self.buf.resize(at + chunks::<V>(), UNINIT);
        // SAFETY: the chunks from `at` were just added, hold no value and
        // span what a `V` (or its box) needs, aligned to `ALIGN`.
        unsafe { store(self.buf.as_mut_ptr().add(at), usize::MAX, v) };
        self.steps.push(Step {
            at,
            run,
            drop: drop_step::<V>,
        });
    }

    /// Runs every step in order, each taken as it runs; the last's output.
    ///
    /// # Safety
    /// The last step leaves a `T`; the context contract of
    /// [`DeviceOp::execute`].
    unsafe fn run<T>(mut self, ctx: &mut ExecutionContext) -> Result<T> {
        let mut slot = Slot([UNINIT; SLOT_BYTES / ALIGN]);
        while let Some(&step) = self.steps.get(self.next) {
            // Taken before it runs: a step that fails or panics has
            // dropped itself, and its input, by then.
            self.next += 1;
            // SAFETY: the step's value is at `at` and not yet taken; the
            // slot holds what the step before left (nothing for the
            // first), as `push`'s contract keeps; the context contract is
            // the caller's.
            unsafe { (step.run)(self.buf.as_mut_ptr().add(step.at), &mut slot, ctx) }?;
        }
        // SAFETY: every step ran; the last left a `T` (the caller's
        // contract).
        Ok(unsafe { slot.take::<T>() })
    }
}

impl Drop for Steps {
    fn drop(&mut self) {
        for step in &self.steps[self.next..] {
            // SAFETY: a step not taken still holds its value.
            unsafe { (step.drop)(self.buf.as_mut_ptr().add(step.at)) };
        }
    }
}

/// A type-erased op ([`DeviceOpExt::boxed`](crate::DeviceOpExt::boxed)).
///
/// Its own [`then`](Boxed::then), [`map`](Boxed::map) and
/// [`boxed`](Boxed::boxed) append to it, so a chain built in a loop runs as
/// a flat list: no allocation a link once its buffer has grown, no depth
/// limit.
///
/// # Examples
///
/// ```no_run
/// use cuda_async::prelude::*;
/// let mut op = value(0u64).boxed();
/// for i in 1..=100_000 {
///     op = op.then(move |x| value(x + i)).boxed();
/// }
/// assert_eq!(op.sync()?, 5_000_050_000);
/// # Ok::<(), cuda_async::Error>(())
/// ```
#[must_use = "ops do nothing until executed (.sync(), .await, ...)"]
pub struct Boxed<'a, T> {
    steps: Steps,
    /// Every step lives for `'a`; the last leaves a `T`; sent across
    /// threads like the `Send` steps it holds, never shared.
    _steps: PhantomData<Marker<'a, T>>,
}

/// What a [`Boxed`] holds, for the compiler: borrows for `'a`, yields a
/// `T`, `Send` but not `Sync`.
type Marker<'a, T> = (&'a (), fn() -> T, Cell<()>);

/// Alias of [`Boxed`], the name used in signatures.
pub type BoxedOp<'a, T> = Boxed<'a, T>;

impl<'a, T: Send> Boxed<'a, T> {
    pub(crate) fn new<O: DeviceOp<Output = T> + 'a>(op: O) -> Self {
        let mut steps = Steps {
            buf: Vec::new(),
            steps: Vec::new(),
            next: 0,
        };
        // SAFETY: the one step reads an `O` and leaves a `T`.
        unsafe { steps.push(op, run_op::<O>) };
        Boxed {
            steps,
            _steps: PhantomData,
        }
    }

    /// [`DeviceOpExt::then`](crate::DeviceOpExt::then), appended to this
    /// op's steps.
    pub fn then<B, F>(mut self, f: F) -> Boxed<'a, <B as DeviceOp>::Output>
    where
        B: DeviceOp,
        F: FnOnce(T) -> B + Send + 'a,
    {
        // SAFETY: the steps so far leave a `T`, which this one reads, and
        // it leaves a `B::Output`, the new type's.
        unsafe { self.steps.push(f, run_then::<T, B, F>) };
        Boxed {
            steps: self.steps,
            _steps: PhantomData,
        }
    }

    /// [`DeviceOpExt::map`](crate::DeviceOpExt::map), appended to this
    /// op's steps.
    pub fn map<U, F>(mut self, f: F) -> Boxed<'a, U>
    where
        U: Send,
        F: FnOnce(T) -> U + Send + 'a,
    {
        // SAFETY: as in `then`, with a `U` left.
        unsafe { self.steps.push(f, run_map::<T, U, F>) };
        Boxed {
            steps: self.steps,
            _steps: PhantomData,
        }
    }

    /// Already boxed: this op itself.
    pub fn boxed(self) -> Self {
        self
    }
}

impl<T> fmt::Debug for Boxed<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Boxed")
            .field("steps", &self.steps.steps.len())
            .finish_non_exhaustive()
    }
}

impl<T: Send> DeviceOp for Boxed<'_, T> {
    type Output = T;

    unsafe fn execute(self, ctx: &mut ExecutionContext) -> Result<T> {
        // SAFETY: the last step leaves a `T` (kept by every constructor);
        // the context contract is forwarded.
        unsafe { self.steps.run(ctx) }
    }
}

impl_into_future!(impl['a, T: Send] for Boxed<'a, T>);
