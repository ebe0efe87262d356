// Holds N arrays of 16k small integers and N strings of 64 KiB (V8's heap: pages V8
// reserves and commits itself, one large-object page per array), then moves them
// through the kernel in every common way (fs with strings, Buffers and small typed
// arrays V8 keeps on its heap; a child's pipes; a TCP socket; zlib; a hash) through
// files in a directory (the second argument), and checks it all.
//
//   uzswap run --budget 128M -- node examples/node_hold.js 1000 /tmp
//
// Prints "node: ok N" when every value is right.
const fs = require('fs'), path = require('path'), zlib = require('zlib');
const crypto = require('crypto'), child = require('child_process'), net = require('net');
const n = parseInt(process.argv[2]), dir = process.argv[3];

function fail(what) { console.log('node: BAD ' + what); process.exit(1); }
function str(i) {
    const b = Buffer.alloc(64 << 10);
    for (let j = 0; j < b.length; j++) b[j] = 97 + ((i * 31 + (j >> 6)) % 26);
    return b.toString('latin1'); // a string on V8's heap, not a view of the Buffer
}
const sha = s => crypto.createHash('sha256').update(s).digest('hex');

const arrs = [], strs = [], sums = [];
for (let i = 0; i < n; i++) {
    const a = new Array(16384);
    for (let j = 0; j < a.length; j++) a[j] = i * 7 + j;
    arrs.push(a);
    strs.push(str(i));
}
for (let i = 0; i < n; i++) sums.push(sha(strs[i]));
function checkArrays(what) {
    for (let i = 0; i < n; i++) {
        const a = arrs[i];
        for (let j = 0; j < a.length; j += 7) if (a[j] !== i * 7 + j) fail(what + ' array ' + i);
    }
}

// Strings and arrays (as JSON) written from the heap, read back into Buffers.
const f = path.join(dir, 'node-hold.txt');
let fd = fs.openSync(f, 'w');
for (let i = 0; i < n; i++) fs.writeSync(fd, strs[i]);
fs.closeSync(fd);
fd = fs.openSync(f, 'r');
const back = Buffer.alloc(64 << 10);
for (let i = 0; i < n; i++) {
    if (fs.readSync(fd, back, 0, back.length, null) !== back.length || back.toString('latin1') !== strs[i]) fail('fs string ' + i);
}
fs.closeSync(fd);
const jf = path.join(dir, 'node-hold.json');
fs.writeFileSync(jf, JSON.stringify(arrs.slice(0, Math.min(n, 64))));
const parsed = JSON.parse(fs.readFileSync(jf, 'utf8'));
parsed.forEach((a, i) => { if (a.length !== 16384 || a[100] !== i * 7 + 100) fail('json ' + i); });

// Small typed arrays, which V8 keeps on its own heap, written and read one record at a time.
const recs = [];
for (let i = 0; i < 4096; i++) { const r = new Uint8Array(32); r.fill(i & 0xff); recs.push(r); }
fd = fs.openSync(f, 'w+');
for (const r of recs) fs.writeSync(fd, r);
for (let i = 0; i < recs.length; i++) {
    const r = new Uint8Array(32);
    if (fs.readSync(fd, r, 0, 32, i * 32) !== 32 || r.some(v => v !== (i & 0xff))) fail('record ' + i);
}
fs.closeSync(fd);

// A child's pipes, zlib and hashes.
for (let i = 0; i < n; i += Math.max(1, n >> 4)) {
    const out = child.spawnSync('cat', [], { input: strs[i], maxBuffer: 1 << 20 });
    if (out.status !== 0 || out.stdout.toString('latin1') !== strs[i]) fail('pipe ' + i);
    if (zlib.gunzipSync(zlib.gzipSync(strs[i])).toString('latin1') !== strs[i]) fail('zlib ' + i);
}
for (let i = 0; i < n; i++) if (sha(strs[i]) !== sums[i]) fail('string ' + i);
checkArrays('before the socket');

// A TCP socket on the loopback: every string out and back, checked as it comes.
const server = net.createServer(s => s.pipe(s)).listen(0, '127.0.0.1', () => {
    const c = net.connect(server.address().port, '127.0.0.1');
    const size = 64 << 10;
    let at = 0;
    c.on('data', d => {
        for (let k = 0; k < d.length; ) {
            const i = Math.floor(at / size), o = at % size, m = Math.min(d.length - k, size - o);
            if (i >= n || d.toString('latin1', k, k + m) !== strs[i].substr(o, m)) fail('socket ' + i);
            k += m;
            at += m;
        }
        if (at < n * size) return;
        checkArrays('after the socket');
        c.end();
        server.close();
        console.log('node: ok ' + n);
    });
    for (let i = 0; i < n; i++) c.write(strs[i], 'latin1');
});
