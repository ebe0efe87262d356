import java.io.*;
import java.nio.ByteBuffer;
import java.nio.channels.FileChannel;
import java.nio.file.*;
import java.util.*;
import java.util.zip.*;

// Holds N MiB of byte[] (the first argument; mostly compressible) and a map of small
// objects, then moves the arrays through the kernel in every common way (java.io streams,
// RandomAccessFile, NIO with heap buffers, a pipe between threads, gzip) through files in
// a directory (the second argument), collects garbage, and checks it all.
//
//   javac -d DIR examples/JavaHold.java
//   uzswap run --budget 256M -- java -Xmx1g -cp DIR JavaHold 384 /tmp
//
// Prints "java: ok N" when every byte is right.
public class JavaHold {
    static byte[] chunk(int i) {
        byte[] b = new byte[1 << 20];
        long x = i * 0x9E3779B97F4A7C15L + 1;
        for (int j = 0; j < b.length; j += 8) {
            x ^= x << 13; x ^= x >>> 7; x ^= x << 17;
            long v = (x & 0xff) < 200 ? i : x; // mostly compressible
            for (int k = 0; k < 8; k++) b[j + k] = (byte) (v >>> (8 * k));
        }
        return b;
    }
    static long sum(byte[] b) { CRC32 c = new CRC32(); c.update(b); return c.getValue(); }
    public static void main(String[] a) throws Exception {
        int n = Integer.parseInt(a[0]);
        File dir = new File(a[1]);
        byte[][] bs = new byte[n][];
        long[] crc = new long[n];
        for (int i = 0; i < n; i++) { bs[i] = chunk(i); crc[i] = sum(bs[i]); }
        HashMap<String, Integer> m = new HashMap<>();
        for (int i = 0; i < 300_000; i++) m.put("key-" + i, i);
        File f = new File(dir, "j.bin");
        try (FileOutputStream o = new FileOutputStream(f)) { for (byte[] b : bs) o.write(b); }
        try (FileInputStream in = new FileInputStream(f)) {
            for (int i = 0; i < n; i++) { int off = 0; while (off < bs[i].length) { int r = in.read(bs[i], off, bs[i].length - off); if (r < 0) throw new EOFException(); off += r; } }
        }
        try (RandomAccessFile r = new RandomAccessFile(f, "r")) { for (int i = n - 1; i >= 0; i -= 3) { r.seek((long) i << 20); r.readFully(bs[i]); } }
        try (FileChannel ch = FileChannel.open(f.toPath(), StandardOpenOption.READ)) {
            for (int i = 0; i < n; i += 2) { ByteBuffer bb = ByteBuffer.wrap(bs[i]); ch.read(bb, (long) i << 20); }
        }
        try (FileChannel ch = FileChannel.open(new File(dir, "k.bin").toPath(), StandardOpenOption.CREATE, StandardOpenOption.WRITE)) {
            for (int i = 0; i < n; i += 5) ch.write(ByteBuffer.wrap(bs[i]));
        }
        PipedOutputStream po = new PipedOutputStream(); PipedInputStream pi = new PipedInputStream(po, 1 << 16);
        Thread t = new Thread(() -> { try { for (int i = 0; i < n; i += 7) po.write(bs[i]); po.close(); } catch (IOException e) { throw new RuntimeException(e); } });
        t.start();
        for (int i = 0; i < n; i += 7) { byte[] got = pi.readNBytes(1 << 20); if (sum(got) != crc[i]) throw new Error("pipe " + i); }
        t.join();
        ByteArrayOutputStream z = new ByteArrayOutputStream();
        try (GZIPOutputStream g = new GZIPOutputStream(z)) { for (int i = 0; i < n; i += 11) g.write(bs[i]); }
        try (GZIPInputStream g = new GZIPInputStream(new ByteArrayInputStream(z.toByteArray()))) {
            for (int i = 0; i < n; i += 11) if (sum(g.readNBytes(1 << 20)) != crc[i]) throw new Error("gzip " + i);
        }
        System.gc();
        for (int i = 0; i < n; i++) if (sum(bs[i]) != crc[i]) throw new Error("chunk " + i);
        for (int i = 0; i < 300_000; i += 997) if (m.get("key-" + i) != i) throw new Error("map " + i);
        System.out.println("java: ok " + n);
    }
}
